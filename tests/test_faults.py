"""Faults as users meet them: corrupt, foreign and poisoned plan files, a plan folder that cannot be written, and an
exception in the middle of a call with a cache of the caller's. Every call either succeeds with plain generate's
output or is refused with the fix; nothing is silently mis-sized and no tree row stays in the caller's cache."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pathlib
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.core.releases import cache_arg
from hf_specdec.methods.sequoia import lookup as plan_lookup
from hf_specdec.methods.sequoia import plan_tree, store
from hf_specdec.methods.sequoia.dp import TreePlan
from hf_specdec.methods.sequoia.plan_file import SequoiaPlan, model_record, pair_placement
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.sizing import HardwareProfile
from hf_specdec.runtime import paths
from tests.conftest import random_prompt
from tests.helpers.faults import (
    FAULTS,
    Boom,
    _interrupt_in_layer,
)

NEW_TOKENS = 16


@pytest.fixture
def plan_dir(tmp_path, monkeypatch):
    """An empty plan folder of this test's own (the session's shared one may hold plans of other tests)."""
    folder = tmp_path / "plans"
    monkeypatch.setattr(store, "user_plan_dir", lambda: folder)
    monkeypatch.setattr(store, "_unsaved", {})
    monkeypatch.setattr(store, "_warned", set())
    return folder


def _prompt(seed: int = 3) -> torch.LongTensor:
    return random_prompt(torch.Generator().manual_seed(seed), 6)


def good_plan(target, draft) -> dict:
    """A valid greedy plan for this pair on this machine, made by hand (no calibration): an 8-node tree."""
    sizes = (1, 4, 16, 64)
    profile = HardwareProfile(LatencyCurve(sizes, (0.010, 0.011, 0.013, 0.020)),
                              LatencyCurve(sizes, (0.002, 0.0022, 0.0026, 0.004)), pair_placement(target, draft))
    tree = plan_tree([0.6, 0.2, 0.1], budget=8, max_depth=4)
    return SequoiaPlan(tree, 0.0, "greedy", profile, model_record(target), model_record(draft),
                       source="test").to_dict()


def _sequoia(target, draft, ids, **kwargs):
    return target.generate(ids, assistant_model=draft, speculation="sequoia", max_new_tokens=NEW_TOKENS,
                           do_sample=False, return_dict_in_generate=True, **kwargs)


def _plan_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "hf_specdec" in str(w.message)]


# ---------------------------------------------------------------- corrupt and foreign files


BROKEN_FILES = {
    "an array": "[]",
    "null": "null",
    "a string": '"plan"',
    "not JSON": '{"format": 1, "tree": ',
    "not UTF-8": b"\xff\xfe{}",
    "an object without a tree": '{"format": 1}',
}


@pytest.mark.parametrize("content", list(BROKEN_FILES.values()), ids=list(BROKEN_FILES))
def test_a_corrupt_plan_file_is_skipped_with_one_warning(qwen2_pair, plan_dir, content):
    """Named as the store names plans (so it is the file the next save replaces): skipped with a warning naming it,
    once, and the call uses the valid plan beside it."""
    target, draft = qwen2_pair
    plan_dir.mkdir()
    (plan_dir / "ok.json").write_text(json.dumps(good_plan(target, draft)))
    broken = plan_dir / "sequoia-broken.json"
    broken.write_bytes(content if isinstance(content, bytes) else content.encode())
    ids = _prompt()
    expected = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first, second = _sequoia(target, draft, ids), _sequoia(target, draft, ids)
    for out in (first, second):
        assert torch.equal(out.sequences, expected)
        assert out.speculation_stats.plan_source == "saved plan ok.json"
    (message,) = _plan_warnings(record)  # one warning for two calls
    assert f"skipping the Sequoia plan file {broken}" in message


@pytest.mark.parametrize("content", ["[]", "null", '"plan"', '{"name": "my settings"}', "not json at all"])
def test_foreign_json_files_in_the_plan_folder_are_ignored(qwen2_pair, plan_dir, content):
    target, draft = qwen2_pair
    plan_dir.mkdir()
    (plan_dir / "ok.json").write_text(json.dumps(good_plan(target, draft)))
    (plan_dir / "settings.json").write_text(content)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for method in ("sequoia", "specexec", "staged"):
            out = target.generate(_prompt(), assistant_model=draft, speculation=method, max_new_tokens=NEW_TOKENS,
                                  do_sample=False, return_dict_in_generate=True)
            assert torch.equal(out.sequences, target.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False))
            assert "ok.json" in out.speculation_stats.plan_source
    assert _plan_warnings(record) == []


# ---------------------------------------------------------------- poisoned values


def _poisoned(plan: dict, path: str, value) -> dict:
    plan = copy.deepcopy(plan)
    *parents, last = path.split(".")
    node = plan
    for key in parents:
        node = node[key]
    node[last] = value
    return plan


POISONS = {
    "NaN expected tokens": ("tree.expected_tokens", math.nan, "expected_tokens nan is impossible"),
    "more expected tokens than nodes": ("tree.expected_tokens", 50.0, "impossible for a tree of 8 nodes"),
    "unknown verifier": ("verifier", "magic", "Unknown verifier 'magic'"),
    "zero draft seconds": ("profile.draft.seconds", [0.0, 0.0, 0.0, 0.0], "finite positive seconds"),
    "negative target seconds": ("profile.target.seconds", [-1.0, 0.1, 0.2, 0.3], "finite positive seconds"),
    "NaN seconds": ("profile.target.seconds", [math.nan] * 4, "finite positive seconds"),
    "infinite seconds": ("profile.draft.seconds", [1e400] * 4, "finite positive seconds"),
    "a chain deeper than its max_depth": ("tree", {"parents": [-1] + list(range(299)), "expected_tokens": 2.0,
                                                   "acceptance": [0.5], "budget": 300, "max_depth": 1},
                                          "300 nodes over 300 levels, beyond its own budget 300 and max_depth 1"),
    "more nodes than the budget": ("tree.budget", 4, "beyond its own budget 4"),
    "acceptance above one in all": ("tree.acceptance", [0.9, 0.5], "sum to at most 1"),
    "negative temperature": ("temperature", -0.5, "temperature must be finite"),
    "negative step overhead": ("profile.step_overhead", -0.1, "step_overhead must be"),
    "a list for a profile": ("profile", [1, 2], "must be a JSON object"),
    "a list for the target record": ("target", ["qwen2"], "must be a JSON object"),
    "an infinite budget": ("tree.budget", 1e400, "infinity"),
}


@pytest.mark.parametrize("path,value,message", list(POISONS.values()), ids=list(POISONS))
def test_a_poisoned_plan_is_refused_by_value(qwen2_pair, tmp_path, path, value, message):
    target, draft = qwen2_pair
    file = tmp_path / "poisoned.json"
    file.write_text(json.dumps(_poisoned(good_plan(target, draft), path, value)))
    with pytest.raises(ValueError, match=f"{file} is not a valid Sequoia plan") as refused:
        SequoiaPlan.load(file)
    assert message in str(refused.value)


def test_a_poisoned_profile_never_sizes_a_call(qwen2_pair, plan_dir):
    """Zero draft seconds made every draft pass look free: specexec grew trees of ~1,260 nodes a step. Now the file
    is skipped with a warning saying why, and the call measures curves of its own."""
    target, draft = qwen2_pair
    plan_dir.mkdir()
    poisoned = plan_dir / "sequoia-poisoned.json"
    poisoned.write_text(json.dumps(_poisoned(good_plan(target, draft), "profile.draft.seconds", [0.0] * 4)))
    ids = _prompt()
    with pytest.warns(UserWarning, match="finite positive seconds") as record:
        out = target.generate(ids, assistant_model=draft, speculation="specexec", max_new_tokens=NEW_TOKENS,
                              do_sample=False, return_dict_in_generate=True)
    assert str(poisoned) in str(record[0].message)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))
    stats = out.speculation_stats
    assert "online calibration" in stats.plan_source
    assert stats.drafted_tokens / stats.target_forwards < 64  # not the hundreds a free draft pass would buy


def test_a_poisoned_plan_given_in_the_call_is_refused_before_any_model_runs(qwen2_pair):
    target, draft = qwen2_pair
    calls = []
    hook = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        for given in (_poisoned(good_plan(target, draft), "verifier", "magic"),
                      {"parents": [-1, 0, 1], "expected_tokens": 1.5, "acceptance": [0.5], "budget": 3,
                       "max_depth": 1},
                      TreePlan([-1, 0, 1], 1.5, [0.5], 3, 1)):
            with pytest.raises(ValueError, match="not a valid plan"):
                _sequoia(target, draft, _prompt(), speculation_config={"plan": given})
    finally:
        hook.remove()
    assert calls == []


# ---------------------------------------------------------------- a plan folder that cannot be written


@pytest.mark.parametrize("method", ["sequoia", "specexec"])
def test_an_unwritable_plan_folder_never_fails_a_call(qwen2_pair, tmp_path, monkeypatch, method):
    """HF_SPECDEC_CACHE under a file (unwritable for root too): the plan made in the call is used and kept in
    memory, one warning says where it could not go and how to fix it, and the next call does not calibrate again."""
    target, draft = qwen2_pair
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(store, "user_plan_dir", lambda: paths.cache_dir() / "plans")
    monkeypatch.setattr(store, "_unsaved", {})
    monkeypatch.setattr(store, "_warned", set())
    ids = _prompt(5)
    expected = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outs = [target.generate(ids, assistant_model=draft, speculation=method, max_new_tokens=NEW_TOKENS,
                                do_sample=False, return_dict_in_generate=True) for _ in range(2)]
    for out in outs:
        assert torch.equal(out.sequences, expected)
    first, second = (out.speculation_stats.plan_source for out in outs)
    assert "online calibration" in first and "kept in memory" in first
    assert "made earlier in this process (kept in memory)" in second and "calibration" not in second
    (message,) = _plan_warnings(record)
    assert str(tmp_path / "a-file" / "cache" / "plans") in message and "Set HF_SPECDEC_CACHE" in message


def test_a_failed_write_leaves_no_file_behind(qwen2_pair, plan_dir, monkeypatch):
    """Writes stay atomic: a write that fails half way leaves neither a plan file nor its temporary file."""
    target, draft = qwen2_pair

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hf_specdec.methods.sequoia.plan_file.os.replace", disk_full)
    with pytest.warns(UserWarning, match="No space left on device"):
        assert store.save_user_plan(SequoiaPlan.from_dict(good_plan(target, draft)), target, draft) is None
    assert list(plan_dir.iterdir()) == []


# ---------------------------------------------------------------- processes sharing a folder


def test_the_plan_lock_lets_one_holder_in_at_a_time(plan_dir):
    entered = threading.Event()

    def second_process():
        with store.plan_lock():
            entered.set()

    with store.plan_lock():
        thread = threading.Thread(target=second_process)
        thread.start()
        assert not entered.wait(0.3)  # blocked while the first holds the lock
    thread.join(5)
    assert entered.is_set()


TWO_PROCESSES_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.conftest import random_prompt, tiny_model
torch.set_num_threads(1)
target, draft = tiny_model("qwen2", 0), tiny_model("qwen2", 1)
out = target.generate(random_prompt(torch.Generator().manual_seed(3), 6), assistant_model=draft, speculation="sequoia",
                      max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
print("SOURCE", out.speculation_stats.plan_source)
"""


def test_two_processes_on_one_folder_calibrate_once(tmp_path):
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, paths.CACHE_ENV: str(tmp_path / "cache")}
    runs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES_SCRIPT.format(root=root)], env=env, cwd=root,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    sources = [line for run in runs for line in run.communicate(timeout=300)[0].splitlines()
               if line.startswith("SOURCE")]
    assert len(sources) == 2 and sum("online calibration" in line for line in sources) == 1
    assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1


def test_a_plan_made_while_waiting_for_the_lock_is_used_not_made_again(qwen2_pair, plan_dir, monkeypatch):
    target, draft = qwen2_pair

    @contextlib.contextmanager
    def lock_released_after_another_process_saved():
        SequoiaPlan.from_dict(good_plan(target, draft)).save(plan_dir / "sequoia-from-the-other-process.json")
        yield

    def must_not_calibrate(*args, **kwargs):
        raise AssertionError("calibrated although another process had made the plan")

    monkeypatch.setattr(store, "plan_lock", lock_released_after_another_process_saved)
    monkeypatch.setattr(plan_lookup, "calibrate", must_not_calibrate)
    out = _sequoia(target, draft, _prompt())
    assert out.speculation_stats.plan_source == "saved plan sequoia-from-the-other-process.json"


# ---------------------------------------------------------------- an exception with the caller's cache


@pytest.mark.parametrize("method", [{"speculation": "specexec", "speculation_config": {"budget": 12}},
                                    {"speculation": "tree"}], ids=["specexec", "tree"])
@pytest.mark.parametrize("fault", list(FAULTS.values()), ids=list(FAULTS))
@pytest.mark.parametrize("cache_state", ["empty", "holding the prompt"])
def test_an_exception_leaves_only_committed_tokens_in_the_callers_cache(qwen2_pair, method, fault, cache_state):
    target, draft = qwen2_pair
    draft = copy.deepcopy(target)  # agrees with the target: long accepted blocks, so a stop can land inside one
    ids = _prompt(7)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    cache = DynamicCache()
    if cache_state == "holding the prompt":
        with torch.no_grad():
            target(ids, **cache_arg(cache), use_cache=True)
    kwargs = fault()
    hook = _interrupt_in_layer(target, kwargs.pop("layer_interrupt")) if "layer_interrupt" in kwargs else None
    try:
        with pytest.raises((Boom, KeyboardInterrupt)):
            target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False, **cache_arg(cache),
                            **method, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    rows = cache.get_seq_length()
    assert rows < plain.shape[1]
    assert all(layer.keys.shape[-2] == rows for layer in cache.layers)
    if rows:  # the rows are those of plain's committed tokens: no tree row, no gap
        reference = DynamicCache()
        with torch.no_grad():
            target(plain[:, :rows], **cache_arg(reference), use_cache=True)
        for ours, theirs in zip(cache.layers, reference.layers, strict=True):
            torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-5)
    # The caller can go on with the same cache: the next call decodes plain's tokens.
    again = target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False, **cache_arg(cache),
                            **method)
    assert torch.equal(again, plain)
