"""The embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B draft) in float32: greedy speculation is lossless."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.core.releases import output_cache
from hf_specdec.methods.sequoia import plan_tree
from hf_specdec_tools.prompts import humaneval_prompts

pytestmark = pytest.mark.real

PROMPTS = humaneval_prompts(3)  # 3 x 48 tokens: the real-pair tests take most of CI on a 2-core AVX2 CPU
NEW_TOKENS = 48


def _plain(real_pair_fp32, **call) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt ids, plain generate's output) for every prompt."""
    target, _, tokenizer = real_pair_fp32
    prompts = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
    return [(ids, target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **call)) for ids in prompts]


@pytest.fixture(scope="module")
def plain_outputs(real_pair_fp32):
    return _plain(real_pair_fp32)


def _speculate(real_pair_fp32, ids, speculation, config=None):
    target, draft, _ = real_pair_fp32
    return target.generate(ids, assistant_model=draft, speculation=speculation, speculation_config=config,
                           max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)


@pytest.mark.parametrize(
    "speculation, config",
    [
        ("chain", None),
        ("tree", None),
        # A fixed Sequoia tree, so speculation happens whatever this machine's latency curves say.
        ("sequoia", {"plan": plan_tree([0.75, 0.1, 0.05, 0.02], budget=24, max_depth=7)}),
        ("specexec", {"budget": 32, "max_depth": 8}),
    ],
    ids=["chain", "tree", "sequoia-fixed-plan", "specexec-32"],
)
def test_greedy_identical_to_plain_on_humaneval(real_pair_fp32, plain_outputs, speculation, config):
    steps = 0
    for ids, expected in plain_outputs:
        out = _speculate(real_pair_fp32, ids, speculation, config)
        assert torch.equal(out.sequences, expected)
        steps += out.speculation_stats.target_forwards
    # The real draft agrees often enough that speculation pays in target passes.
    assert steps < len(PROMPTS) * NEW_TOKENS / 2


def test_a_draft_given_the_prompts_last_tokens_changes_no_output(real_pair_fp32, plain_outputs):
    """`draft_window` below the prompts' lengths (the default, 1,024, is above them): the draft's first pass reads
    the last 32 tokens, the output is plain's."""
    _, draft, _ = real_pair_fp32
    first_reads = []
    hook = draft.register_forward_pre_hook(
        lambda module, args, kwargs: first_reads.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        for ids, expected in plain_outputs:
            first_reads.clear()
            assert ids.shape[1] > 32
            out = _speculate(real_pair_fp32, ids, "specexec", {"budget": 32, "max_depth": 8, "draft_window": 32})
            assert torch.equal(out.sequences, expected)
            assert 32 <= first_reads[0] < ids.shape[1]  # the window, and at most the first tree level with it
    finally:
        hook.remove()


@pytest.mark.parametrize("speculation", ["chain", "tree", "sequoia"])
def test_left_padded_batch_identical_to_plain_batched_generate(real_pair_fp32, speculation):
    """Three HumanEval prompts of different lengths, left-padded into one batch: row by row what plain batched
    generate writes, and the cache it returns (issue 25)."""
    target, draft, tokenizer = real_pair_fp32
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()  # the prompts really differ in length
    plain = target.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    out = target.generate(**batch, assistant_model=draft, speculation=speculation, max_new_tokens=NEW_TOKENS,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert sum(row.target_forwards for row in out.speculation_stats) < len(PROMPTS) * NEW_TOKENS / 2
    for ours, theirs in zip(output_cache(out).layers, output_cache(plain).layers, strict=True):  # plain's cache
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-3, rtol=1e-3)  # 1.5B in float32, other shapes
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-3, rtol=1e-3)


def test_returned_scores_logits_and_hidden_states_equal_plain(real_pair_fp32, plain_outputs):
    """return_dict_in_generate with every per-token output the real target's SDPA attention gives: plain's values."""
    from tests.helpers.outputs import assert_outputs_equal

    target, draft, _ = real_pair_fp32
    ids = plain_outputs[1][0]
    asked = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_scores=True,
                 output_logits=True, output_hidden_states=True)
    expected = target.generate(ids, **asked)
    out = target.generate(ids, assistant_model=draft, speculation="tree", **asked)
    assert out.speculation_stats.target_forwards < 16
    assert_outputs_equal(out, expected, tolerance=1e-3, hidden_tolerance=1e-3)  # 1.5B in float32, other shapes


@pytest.mark.parametrize("speculation", ["sequoia", "specexec", "staged"])
def test_automatic_plans_are_lossless(real_pair_fp32, plain_outputs, speculation):
    """No settings at all: the plan or budget is found, re-sized for this machine, or calibrated, and says so."""
    ids, expected = plain_outputs[0]
    out = _speculate(real_pair_fp32, ids, speculation)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.plan_source


def test_offloaded_target_is_lossless(real_pair_fp32, plain_outputs, tmp_path):
    """The real target with 27 of its 28 layers on disk (accelerate), the draft in memory: SpecExec on it gives
    plain's tokens, and the offloaded target alone decodes as the one in memory."""
    from transformers import AutoModelForCausalLM

    from hf_specdec.runtime.devices import is_offloaded
    from hf_specdec_tools import models

    _, draft, _ = real_pair_fp32
    offloaded = AutoModelForCausalLM.from_pretrained(
        models.fetch(models.DEFAULT_TARGET), dtype=torch.float32, device_map="auto", max_memory={"cpu": "2GiB"},
        offload_folder=str(tmp_path / "offload"),
    ).eval()
    assert is_offloaded(offloaded)
    assert sum(place == "disk" for name, place in offloaded.hf_device_map.items() if ".layers." in name) >= 20
    ids, expected = plain_outputs[0]
    out = offloaded.generate(ids, assistant_model=draft, speculation="specexec", max_new_tokens=NEW_TOKENS,
                             speculation_config={"budget": 16}, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.target_forwards < NEW_TOKENS / 2
    plain = offloaded.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, expected[:, : ids.shape[1] + 12])


def test_int8_quantized_real_target_is_lossless(real_pair_fp32):
    """The real target loaded through TorchAoConfig (int8 weight-only, as `--quantize-target int8` does): specexec
    gives the tokens plain `generate` gives on that same quantized target, with fewer target passes than tokens."""
    pytest.importorskip("torchao", reason="torchao is a test requirement (pyproject [test])")
    from transformers import AutoModelForCausalLM

    from hf_specdec.runtime.model_info import quantization
    from hf_specdec_tools import models
    from hf_specdec_tools.bench.target_quantization import quantization_config

    _, draft, tokenizer = real_pair_fp32
    target = AutoModelForCausalLM.from_pretrained(models.fetch(models.DEFAULT_TARGET), dtype=torch.float32,
                                                  quantization_config=quantization_config("int8")).eval()
    assert quantization(target) == "torchao:Int8WeightOnlyConfig"
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=draft, speculation="specexec", speculation_config={"budget": 16},
                          max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.target_forwards < 24 / 2


@pytest.fixture(scope="module")
def plain_static_outputs(real_pair_fp32):
    return _plain(real_pair_fp32, cache_implementation="static")


@pytest.mark.parametrize(
    "speculation, config",
    [("sequoia", {"plan": plan_tree([0.75, 0.1, 0.05, 0.02], budget=24, max_depth=7)}),
     ("chain", {"num_draft_tokens": 6, "confidence_threshold": 0, "per_step": False, "draft_window": 32}),
     ("sequoia", {}),
     ("specexec", {"budget": 16}),
     ("specexec", {})],
    ids=["sequoia-fixed-plan", "chain-6-window-32", "sequoia-sized-buckets", "specexec-grown-16",
         "specexec-sized-budgets"],
)
def test_captured_steps_identical_to_plain_static_generate(real_pair_fp32, plain_static_outputs, speculation, config):
    """`captured=True` (decoding/captured.py): each step one function of device work, read once; plain static-cache
    generate's tokens on the real pair, the draft reading the prompt whole or its last 32 tokens; `sequoia` at its
    defaults drafting the bucketed shapes its cost model picks every step; `specexec`'s best-first trees grown on the
    device, of a fixed budget and of the few budgets it is sized from every step."""
    target, draft, _ = real_pair_fp32
    steps = 0
    for ids, expected in plain_static_outputs:
        out = target.generate(ids, assistant_model=draft, speculation=speculation, do_sample=False,
                              speculation_config={**config, "captured": True, "guard": False},
                              max_new_tokens=NEW_TOKENS, cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.speculation_stats.captured
        steps += out.speculation_stats.target_forwards
    assert steps < len(PROMPTS) * NEW_TOKENS / 2


def test_captured_plain_steps_among_trees_identical_to_plain_static_generate(real_pair_fp32, plain_static_outputs,
                                                                            monkeypatch):
    """Captured plain steps (the root alone: the guard's or a sized schedule's), one in every three steps among a
    6-token chain's, with the guard on: the draft catches up on the real pair's caches between them; plain static-cache
    generate's tokens."""
    from tests.helpers.plain_steps import plain_steps_where

    plain_steps_where(monkeypatch, lambda step: step % 3 == 0)
    target, draft, _ = real_pair_fp32
    for ids, expected in plain_static_outputs:
        out = target.generate(ids, assistant_model=draft, speculation="chain", do_sample=False,
                              speculation_config={"num_draft_tokens": 6, "confidence_threshold": 0, "per_step": False,
                                                  "captured": True},
                              max_new_tokens=NEW_TOKENS, cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        stats = out.speculation_stats
        assert stats.plain_steps >= 3 and max(stats.tokens_per_step) > 3, stats.tokens_per_step
