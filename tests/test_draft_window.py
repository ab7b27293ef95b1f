"""The draft reads only the prompt's last `draft_window` tokens: output unchanged, the draft's passes shorter."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from hf_specdec import ChainConfig, SpecExecConfig, TreeConfig
from hf_specdec.core import config as core_config
from hf_specdec.core.model_inputs import TokenInputs
from hf_specdec.draft.draft_model import DraftModelRunner
from tests.conftest import random_prompt
from tests.tiny import build, tiny_model

METHODS = [
    ChainConfig(num_draft_tokens=4),
    TreeConfig(widths=[2, 2]),
    SpecExecConfig(budget=12, max_depth=4, width=3),
    "sequoia",
    "staged",
]


class DraftReads:
    """Counts the tokens each of the draft model's passes is given (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.lengths: list[int] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[1]))

    def __enter__(self) -> DraftReads:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def _generate(target, draft, ids, speculation, settings=None, **kwargs):
    if settings is not None:
        kwargs["speculation_config"] = settings
    return target.generate(ids, assistant_model=draft, speculation=speculation, do_sample=False, max_new_tokens=24,
                           **kwargs)


@pytest.mark.parametrize("speculation", METHODS, ids=lambda c: c if isinstance(c, str) else c.method)
@pytest.mark.parametrize("window", [1, 6, 0])
def test_a_windowed_draft_changes_no_output_and_reads_only_the_window(tiny_pair, speculation, window):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(window), 40)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    _generate(target, draft, ids[:, :4], speculation)  # first calls calibrate or time passes: not counted
    with DraftReads(draft) as reads:
        out = _generate(target, draft, ids, speculation, {"draft_window": window})
    assert torch.equal(out, expected)
    # the first pass reads the window (0: the whole prompt), and with it the first tree level where a method
    # forwards both in one pass (at most 16 nodes here)
    assert (window or ids.shape[1]) <= reads.lengths[0] <= (window or ids.shape[1]) + 16


def test_the_default_window_applies_to_long_prompts_only(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    monkeypatch.setattr(core_config, "DRAFT_WINDOW", 8)
    for length, read in ((20, 8), (8, 8), (5, 5)):
        ids = random_prompt(torch.Generator().manual_seed(length), length)
        expected = target.generate(ids, do_sample=False, max_new_tokens=24)
        with DraftReads(draft) as reads:
            out = _generate(target, draft, ids, "chain", {"confidence_threshold": 0.4})  # no plan to look up
        assert torch.equal(out, expected)
        assert reads.lengths[0] == read  # a chain's first pass reads the prompt (or its window) alone


def test_a_window_placed_in_a_call_stays_for_the_call_and_moves_with_the_next():
    draft = tiny_model("llama", 1)
    runner = DraftModelRunner(draft)
    runner.use_window(4)
    runner.sync(list(range(3, 13)))  # a 10-token prompt: the draft reads its last 4
    assert runner.dropped == 6 and runner.committed == list(range(9, 13))
    runner.sync(list(range(3, 15)))  # two more tokens: read, the window's start stays
    assert runner.dropped == 6 and runner.committed == list(range(9, 15))
    logits, nodes = runner.forward_tree(torch.tensor([20, 21]), torch.tensor([1, 1]),
                                        torch.eye(2, dtype=torch.bool), list(range(3, 16)))
    assert nodes.shape[0] == 2 and runner.num_nodes == 2
    runner.commit(list(range(3, 16)) + [20, 30], [0])  # node 20 accepted, 30 the bonus token
    assert runner.committed == list(range(9, 16)) + [20]
    with torch.no_grad():  # the same logits as a draft that was only ever given the window's tokens
        window_only = draft(torch.tensor([list(range(9, 16)) + [20, 30]])).logits[0, -1]
    torch.testing.assert_close(runner.sync(list(range(3, 16)) + [20, 30]), window_only.float(), rtol=1e-4,
                               atol=1e-4)
    runner2 = DraftModelRunner(draft)
    runner2.use_window(None)
    runner2.sync(list(range(3, 13)))
    assert runner2.dropped == 0 and len(runner2.committed) == 10


def test_token_types_are_placed_by_their_place_in_the_sequence():
    draft = build(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=0), 1)
    runner = DraftModelRunner(draft)
    runner.use_window(3)
    types = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 3]])
    runner.token_inputs = TokenInputs({"token_type_ids": types}).for_model(draft)
    seen = []
    handle = draft.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("token_type_ids")), with_kwargs=True)
    try:
        runner.sync(list(range(3, 11)))  # 8 tokens: the draft reads the last 3, whose types are 2, 2, 3
    finally:
        handle.remove()
    assert seen[0].tolist() == [[2, 2, 3]]


@pytest.mark.parametrize("window", [-1, 2.5, "all", True])
def test_a_bad_window_is_refused(tiny_pair, window):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(0), 6)
    with pytest.raises(ValueError, match="draft_window"):
        _generate(target, draft, ids, "chain", {"draft_window": window})


def test_prompt_lookup_has_no_draft_to_window(tiny_pair):
    target, _ = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(0), 6)
    with pytest.raises(ValueError, match="draft_window"):
        target.generate(ids, speculation="prompt_lookup", speculation_config={"draft_window": 4}, max_new_tokens=4)


def test_a_batch_refuses_an_explicit_window_and_reads_whole_prompts_by_default(tiny_pair):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(0), 12).repeat(2, 1)
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match="draft_window"):
        _generate(target, draft, ids, "tree", {"draft_window": 4}, attention_mask=mask)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    assert torch.equal(_generate(target, draft, ids, "tree", attention_mask=mask), expected)


def test_a_staged_stack_windows_every_model_stage(tiny_pair):
    target, draft = tiny_pair
    small = tiny_model(target.config.model_type, 2)
    ids = random_prompt(torch.Generator().manual_seed(1), 40)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    with DraftReads(draft) as top, DraftReads(small) as below:
        out = _generate(target, draft, ids, "staged", {"stages": [small, "prompt_lookup"], "draft_window": 6})
    assert torch.equal(out, expected)
    assert 6 <= top.lengths[0] <= 6 + 16 and 6 <= below.lengths[0] <= 6 + 16  # not the 40-token prompt


@pytest.mark.parametrize("speculation", ["chain", "specexec"])
def test_a_windowed_draft_on_a_static_cache(tiny_pair, speculation):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(2), 40)
    expected = target.generate(ids, do_sample=False, max_new_tokens=24, cache_implementation="static")
    _generate(target, draft, ids[:, :4], speculation)  # `specexec` measures latency curves at its first call
    with DraftReads(draft) as reads:
        out = _generate(target, draft, ids, speculation, {"draft_window": 6}, cache_implementation="static")
    assert torch.equal(out, expected)
    assert 6 <= reads.lengths[0] <= 6 + 16
