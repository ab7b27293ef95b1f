"""Shared fixtures: tiny random Llama/Qwen2 models (fast, fp32) and the embedded real pair (slow, on demand)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import hf_specdec  # noqa: F401  (installs `speculation=`)
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_config, tiny_model, tiny_tokenizer  # noqa: F401  (the one factory, re-exported)


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models run fastest on one thread, and two-thread OpenMP stalls badly on a busy 2-core machine;
    tests of the real pair (marked `real`) keep every thread."""
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("real") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: files outside the fast tier (`make test-fast`, `-m "not slow and not real"`): Monte-Carlo sampling frequencies,
#: the model-family matrix, the benchmark harness, the command line and the examples, end to end
SLOW_FILES = {"test_sampling_generate.py", "test_families.py", "test_bench.py", "test_cli.py", "test_examples.py",
              "test_models_fetch.py"}


#: single cases outside the fast tier (`make test` still runs them, unchanged), each 15-30 s on 2 busy cores while
#: faster cases of the same test stay in it: exact enumeration of with-replacement (SpecInfer) drafts on the largest
#: trees and vocabularies, Monte-Carlo frequencies, an end-to-end chi-square, two processes calibrating at once, a
#: compiled forward, the largest specexec budget; `file::name[params]`, or `file::name` for every parametrisation
SLOW_CASES = {
    "test_sampling_exact.py::test_exact_distribution[dense-irregular-SpecInferVerifier]",
    "test_sampling_exact.py::test_exact_distribution[draft_vocab_larger-irregular-SpecInferVerifier]",
    "test_sampling_exact.py::test_exact_distribution[dense-widths22-SpecInferVerifier]",
    "test_sampling_exact.py::test_monte_carlo_matches_target",
    "test_staged.py::test_sampling_through_generate_matches_plain_sampling",
    "test_faults.py::test_two_processes_on_one_folder_calibrate_once",
    "test_static_cache.py::test_forward_the_user_compiled_works",
    "test_greedy_lossless.py::test_identical_to_plain_on_random_prompts[llama-specexec-specexec-True-40-12-4-2-2048]",
    "test_greedy_lossless.py::test_identical_to_plain_on_random_prompts[qwen2-specexec-specexec-True-40-12-4-2-2048]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in SLOW_FILES or f"{name}::{item.name}" in SLOW_CASES or f"{name}::{item.originalname}" in SLOW_CASES:
            item.add_marker(pytest.mark.slow)


PACKAGE = Path(hf_specdec.__file__).resolve().parent
#: a library's deprecation warnings say a call is deprecated; these say the package itself is (shown to its users)
OWN_DEPRECATIONS = (PACKAGE / "core" / "releases.py",)


def _calling_frame(stacklevel: int):
    """The first frame from the warning's origin outward that is not a library's (site-packages, the stdlib): the
    code that made the deprecated call."""
    frame = sys._getframe(stacklevel + 1)
    while frame is not None and ("site-packages" in frame.f_code.co_filename
                                 or frame.f_code.co_filename.startswith(sys.base_prefix)):
        frame = frame.f_back
    return frame


@pytest.fixture(autouse=True)
def no_deprecated_calls_from_the_package(monkeypatch):
    """Fail a test when the package itself calls something its owner says will go (a Transformers argument renamed in
    5.24, ...): the first non-library frame of every FutureWarning must not be the package's."""
    original = warnings.warn

    def warn(message, category=None, stacklevel=1, source=None, **kwargs):
        kind = category or (type(message) if isinstance(message, Warning) else UserWarning)
        if issubclass(kind, FutureWarning):
            frame = _calling_frame(stacklevel)
            path = Path(frame.f_code.co_filename).resolve() if frame is not None else None
            if path is not None and path.is_relative_to(PACKAGE) and path not in OWN_DEPRECATIONS:
                raise AssertionError(f"the package made a deprecated call at {path}:{frame.f_lineno}: {message}")
        return original(message, category, stacklevel + 1, source, **kwargs)

    monkeypatch.setattr(warnings, "warn", warn)


@pytest.fixture(autouse=True)
def isolated_machine_choices(tmp_path, monkeypatch):
    """What demo/bench remember per machine goes to a temporary folder: each test measures afresh."""
    from hf_specdec_tools.bench import machine_choices

    monkeypatch.setattr(machine_choices, "cache_dir", lambda: tmp_path)


@pytest.fixture(autouse=True)
def fresh_lookup_learning(monkeypatch):
    """What prompt lookup's sizing learns is kept per target across calls (methods/prompt_lookup/sizing.py); across
    tests it would make a test's trees depend on which tests ran before it on the same shared tiny model."""
    import weakref

    from hf_specdec.methods.prompt_lookup import sizing as lookup_sizing

    monkeypatch.setattr(lookup_sizing, "_LEARNED", weakref.WeakKeyDictionary())


@pytest.fixture(autouse=True)
def isolated_plan_store(tmp_path_factory, monkeypatch):
    """Plans that tests make (online calibration, re-sizing) go to a temporary folder, never the user's cache."""
    from hf_specdec.methods.sequoia import store

    folder = tmp_path_factory.getbasetemp() / "plans"
    monkeypatch.setattr(store, "user_plan_dir", lambda: folder)
    return folder


@pytest.fixture(autouse=True)
def guard_never_fires(monkeypatch):
    """The measured guard (plan/guard.py) decides by wall time; on tiny models whose draft costs what the target
    does it may rightly turn steps plain, and how often depends on the machine's load. Tests that check a method
    really speculates must not depend on that, so the guard here never judges speculation the loser; its decisions
    are tested in test_sized_trees.py, which patches its own guard over this one."""
    import functools
    import math
    import weakref

    from hf_specdec.draft import guarded
    from hf_specdec.integration import batch
    from hf_specdec.plan import guard
    from hf_specdec.plan.guard import PlainGuard

    monkeypatch.setattr(guard, "_REMEMBERED", weakref.WeakKeyDictionary())  # no guard carries over from another test
    monkeypatch.setattr(guarded, "PlainGuard", functools.partial(PlainGuard, margin=math.inf))
    # a single sequence's guard is `guarded.PlainGuard` as patched (here, or over this in test_sized_trees.py), without
    # the measured plain steps `sequence_guard` adds (tested in test_sized_trees.py)
    monkeypatch.setattr(guarded, "sequence_guard", lambda: guarded.PlainGuard())
    monkeypatch.setattr(batch, "PlainGuard", functools.partial(PlainGuard, margin=math.inf))
    monkeypatch.setattr(batch, "BATCH_MARGIN", math.inf)  # what a batch passes its guard as the margin


@pytest.fixture(autouse=True)
def tree_sizing_sees_a_cheap_draft(monkeypatch):
    """The methods sized every step by shape (`tree` at its default shape, `chain` and `sequoia` at theirs:
    `StaticShapeConfig.sized_drafter`), and a batch's fixed shapes (`draft.batch_sized`), are sized
    every step with the pair's latency curves, and a batch call is priced with them before it starts. The suite's
    tiny drafts cost what their targets do, and curves measured on a busy machine are noise, so there the sizing
    would (rightly, or by chance) run plain steps. Tests that check a method really speculates assume hardware where
    speculation pays; this states it: the cost model sees a target pass of 10 ms whatever its size and a draft pass
    of 0.2 ms (a batch whose rows draft one after another, `specexec`'s, is priced with their passes summed: 4 rows
    still draft a level in under a tenth of a target pass), no correction from measured passes (timing_memory=1:
    load cannot move it), and a first child kept 80% of the time before any verdict (plans are stored per
    architecture, so a plan another test calibrated with a poor draft must not start this draft at plain steps;
    verdicts still teach it; a batch drafted row by row is priced on the DP's trees for that vector, not a stored
    plan's). How the sizing chooses with costly and cheap drafts is tested in test_sized_trees.py with its own
    curves."""
    import dataclasses

    from hf_specdec.integration import batch
    from hf_specdec.methods import static_shape
    from hf_specdec.methods.sequoia.sizing import sequoia_menu
    from hf_specdec.plan.latency import LatencyCurve
    from hf_specdec.plan.shape_sizing import RankAcceptance

    measured = static_shape.online_sizer

    def cheap_draft(profile, target, draft, processors):
        sizer = measured(profile, target, draft, processors)
        flat = lambda seconds: LatencyCurve((1, 128), (seconds, seconds))  # noqa: E731
        sizer.profile = dataclasses.replace(profile, target=flat(0.01), draft=flat(0.0002), step_overhead=0.0)
        sizer.timing_memory = 1.0
        return sizer

    prior = [0.8, 0.1, 0.05]
    for module in (static_shape, batch):  # a batch's fixed shapes are sized every step with the same model
        monkeypatch.setattr(module, "online_sizer", cheap_draft)
        monkeypatch.setattr(module, "RankAcceptance", lambda vector, ranks: RankAcceptance(prior, ranks))
    monkeypatch.setattr(batch, "sequoia_menu", lambda vector, budget, depth: sequoia_menu(prior, budget, depth))



@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_pair(request):
    """(target, draft) of one architecture: the draft is a differently seeded model of the same vocabulary."""
    return tiny_model(request.param, 0), tiny_model(request.param, 1)


@pytest.fixture(scope="module")
def llama_pair():
    """A tiny Llama target and another tiny Llama (other weights) as its draft: most of the suite's pair."""
    return tiny_model("llama", 0), tiny_model("llama", 1)


@pytest.fixture(scope="module")
def qwen2_pair():
    """The same in Qwen2."""
    return tiny_model("qwen2", 0), tiny_model("qwen2", 1)


def random_prompt(generator: torch.Generator, length: int) -> torch.LongTensor:
    # Tokens >= 3 so no prompt contains pad/bos/eos.
    return torch.randint(3, VOCAB, (1, length), generator=generator)


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny models' word-level tokenizer (`tests.tiny.tiny_tokenizer`), one per test module."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def stop_tokenizer():
    """The tiny tokenizer as StopStringCriteria needs one: it reads each token's text as "abcdef" + token decoded
    minus "abcdef", so that word must exist (it takes id 63) and tokens must decode without separators."""
    tokenizer = tiny_tokenizer()
    vocab = {**{t: i for t, i in tokenizer.get_vocab().items() if i != VOCAB - 1}, "abcdef": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.WhitespaceSplit(), decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def real_pair_fp32():
    """The embedded Qwen2.5-Coder 1.5B/0.5B pair in float32 (fetched and converted on first use)."""
    from hf_specdec_tools import models

    target, draft, tokenizer = models.load_default_pair(dtype=torch.float32)
    return target, draft, tokenizer
