"""The draft's lean pass (`kernels/lean_pass.py`) computes what the model's own forward computes, on tree masks."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_specdec import TokenTree, quantize_draft
from hf_specdec.core.releases import cache_arg
from hf_specdec.draft import draft_model
from hf_specdec.draft.draft_model import DraftModelRunner
from hf_specdec.kernels import lean_pass
from hf_specdec.kernels.fused_int4 import FusedInt4
from hf_specdec.kernels.lean_pass import LeanPass
from hf_specdec.kernels.row_dispatch import set_narrow_rows
from hf_specdec.kernels.weight_only import Int4Linear
from hf_specdec.runtime.attention import AttentionLayout
from tests.helpers.lean import PAIRS, assert_lean_pass_equals_the_model
from tests.helpers.methods import GREEDY  # the methods at fixed shapes
from tests.tiny import VOCAB, build, tiny_model


@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("keep", [0, 3])
def test_lean_pass_equals_the_model_on_a_tree(name: str, keep: int):
    assert_lean_pass_equals_the_model(PAIRS[name](), keep, atol=2e-5, rtol=1e-4)


def test_drafts_of_other_families_keep_their_forward():
    gpt2 = build(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128))
    assert DraftModelRunner(gpt2).lean is None
    llama = tiny_model("llama", 0)
    assert DraftModelRunner(llama).lean is not None
    llama.forward = llama.forward  # a forward the user wrapped (here: bound to the instance)
    assert DraftModelRunner(llama).lean is None


def test_forward_hooks_see_every_lean_pass():
    """Hooks on the draft (profilers, benchmarks' pass clocks) see a lean pass as one call of the model; the model's
    own forward is back afterwards."""
    model, seen = tiny_model("qwen2", 0), []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    runner = DraftModelRunner(model)
    runner.sync([5, 9, 11, 4])
    runner.forward_tree(torch.tensor([12, 13]), torch.tensor([1, 2]), torch.tensor([[True, False], [True, True]]))
    assert seen == [4, 2] and "forward" not in vars(model)


@pytest.fixture
def lean_calls(monkeypatch) -> list[int]:
    """The rows of every lean pass runners built from here on make."""
    calls: list[int] = []

    class Counted(LeanPass):
        def __call__(self, *args):
            calls.append(args[0].shape[1])
            return super().__call__(*args)

    monkeypatch.setattr(draft_model, "LeanPass", Counted)
    return calls


def test_runner_tree_pass_takes_the_lean_pass_and_matches_the_model(lean_calls):
    """Through the runner: node logits of a tree pass with and without the lean pass are the same."""
    model = tiny_model("qwen2", 1)
    tokens, depths = torch.tensor([12, 13, 14]), torch.tensor([1, 1, 2])
    sees = torch.tensor([[True, False, False], [False, True, False], [True, False, True]])
    results = []
    for lean in (True, False):
        runner = DraftModelRunner(model)
        if not lean:
            runner.lean = None
        runner.sync([5, 9, 11, 4])
        results.append(runner.forward_tree(tokens, depths, sees, [5, 9, 11, 4, 7])[1])
    assert lean_calls == [4, 4]  # the lean runner's catch-up (four tokens) and tree pass (one fresh token, three nodes)
    torch.testing.assert_close(results[0], results[1], atol=2e-5, rtol=1e-4)


def test_long_catch_ups_keep_the_models_causal_pass(lean_calls):
    model = tiny_model("llama", 0)
    runner, plain = DraftModelRunner(model), DraftModelRunner(model)
    plain.lean = None
    prompt = list(range(3, 3 + draft_model.LEAN_CATCH_UP + 2))
    torch.testing.assert_close(runner.sync(prompt), plain.sync(prompt))  # 18 fresh tokens: the model's own pass
    torch.testing.assert_close(runner.sync(prompt + [9, 10]), plain.sync(prompt + [9, 10]), atol=2e-5, rtol=1e-4)
    assert lean_calls == [2]  # the short catch-up only


# ------------------------------------------------------------------ int4 drafts: projections fused into one call

#: widths the int4 kernel's packed blocks (64 output rows) take whole: query 128, key and value 64 each, MLP 256
PACKABLE = dict(hidden_size=128, intermediate_size=256)


@pytest.mark.parametrize("scheme", ["int4", "mixed"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: query/key/value with biases
def test_fused_int4_projections_are_the_separate_layers_bit_for_bit(family, scheme):
    draft = quantize_draft(tiny_model(family, 0, **PACKABLE), scheme=scheme)
    set_narrow_rows(draft, 4)
    attention, mlp = draft.model.layers[0].self_attn, draft.model.layers[0].mlp
    qkv = FusedInt4.of([attention.q_proj, attention.k_proj, attention.v_proj])
    gate_up = FusedInt4.of([mlp.gate_proj, mlp.up_proj])
    assert qkv is not None and gate_up is not None
    for rows in (1, 3):
        x = torch.randn(1, rows, draft.config.hidden_size, dtype=torch.bfloat16)
        assert qkv.takes(x) and gate_up.takes(x)
        assert torch.equal(qkv(x), torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1))
        assert torch.equal(gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
    if scheme == "mixed":  # wider passes take the int8 copies: the separate layers, not the fused int4 call
        set_narrow_rows(draft, 2)
        assert not qkv.takes(torch.randn(1, 3, draft.config.hidden_size))


def test_fused_int4_holds_the_weights_once_and_is_built_once():
    draft = quantize_draft(tiny_model("qwen2", 0, **PACKABLE), scheme="int4")
    attention = draft.model.layers[1].self_attn
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    fused = FusedInt4.of(parts)
    storage = fused.stack.packed_weight.untyped_storage().data_ptr()
    assert all(part.packed_weight.untyped_storage().data_ptr() == storage for part in parts)  # views of the stack
    assert FusedInt4.of(parts) is fused  # a later runner reuses it
    attention.k_proj.packed_weight = attention.k_proj.packed_weight.clone()  # a part changed since: built again
    assert FusedInt4.of(parts) is not fused


def test_layers_that_cannot_share_one_int4_call_stay_separate():
    plain = tiny_model("llama", 0, **PACKABLE).model.layers[0].self_attn  # float layers: no int4 copies
    assert FusedInt4.of([plain.q_proj, plain.k_proj, plain.v_proj]) is None
    for widths in ((64, 24), (32, 64), (64, 32, 64)):  # a padded block; a layer but the last not filling its blocks
        assert FusedInt4.of([Int4Linear(torch.nn.Linear(32, width), 32) for width in widths]) is None, widths
    assert FusedInt4.of([Int4Linear(torch.nn.Linear(32, width), 32) for width in (64, 128, 16)]) is not None
    tiny = quantize_draft(tiny_model("llama", 0), scheme="int4").model.layers[0].self_attn  # query 32 rows wide
    assert FusedInt4.of([tiny.q_proj, tiny.k_proj, tiny.v_proj]) is None
    mixed = quantize_draft(tiny_model("llama", 0, **PACKABLE), scheme="mixed").model.layers[0].self_attn
    assert FusedInt4.of([mixed.q_proj, Int4Linear(torch.nn.Linear(128, 64), 32)]) is None  # two kinds of layer


def test_a_fused_call_that_does_not_match_the_separate_ones_is_not_used(monkeypatch):
    """Were the kernel's packed layout other than measured (the fused call's outputs off), the probe row at build time
    keeps the layers apart. The mismatch is made, not waited for: which layouts happen to agree depends on the CPU
    (a 16-row packing block matched on an AVX2-only Zen 3)."""
    fused_call = FusedInt4.__call__
    monkeypatch.setattr(FusedInt4, "__call__", lambda self, x: fused_call(self, x) + 1)
    parts = [Int4Linear(torch.nn.Linear(32, 64), 32) for _ in range(2)]
    weights = [part.packed_weight.clone() for part in parts]
    assert FusedInt4.of(parts) is None and FusedInt4.of(parts) is None  # refused once, not tried again
    assert all(torch.equal(part.packed_weight, weight) for part, weight in zip(parts, weights))


@pytest.mark.parametrize("scheme", ["int4", "mixed"])
def test_lean_pass_of_an_int4_draft_with_fused_calls_is_the_one_without(scheme, monkeypatch):
    """Bit for bit, at every pass width (a "mixed" draft's wide passes take its int8 copies, unfused), and close to
    the quantized model's own forward."""
    draft = quantize_draft(tiny_model("qwen2", 1, **PACKABLE), scheme=scheme)
    set_narrow_rows(draft, 2)
    layers = AttentionLayout.of(draft).layer_types
    fused = LeanPass.of(draft, layers)
    monkeypatch.setattr(lean_pass.FusedInt4, "of", lambda linears: None)
    separate = LeanPass.of(draft, layers)
    assert fused.qkv[0] is not None and separate.qkv[0] is None
    prefix = torch.tensor([[5, 9, 11, 4, 7, 3]])
    two, five = TokenTree.from_parents([7, 12], [-1, 0]), TokenTree.from_parents([7, 12, 13, 14, 15], [-1, 0, 0, 1, 1])
    for tree in (two, five):
        out, caches = [], [DynamicCache() for _ in range(3)]
        masks = AttentionLayout.of(draft).tree_masks(tree, 5, torch.bfloat16)
        with torch.no_grad():
            for cache in caches:
                draft(prefix[:, :5], **cache_arg(cache), use_cache=True)
            for run, cache in zip((fused, separate), caches):
                out.append(run(tree.tokens[None], tree.position_ids(5), masks, cache, 0))
            theirs = draft(input_ids=tree.tokens[None], position_ids=tree.position_ids(5), attention_mask=masks,
                           **cache_arg(caches[2]), use_cache=True).logits
        assert torch.equal(out[0], out[1]), len(tree)
        torch.testing.assert_close(out[0].float(), theirs.float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("method", ["chain", "sequoia", "specexec"])
def test_int4_draft_with_fused_calls_keeps_generate_lossless(method, monkeypatch):
    """End to end, each method at a fixed shape: an int4 draft whose passes take the fused calls; greedy output is
    plain `generate`'s."""
    calls, call = [], FusedInt4.__call__
    monkeypatch.setattr(FusedInt4, "__call__", lambda self, x: calls.append(1) or call(self, x))
    target = tiny_model("qwen2", 0, **PACKABLE)
    draft = quantize_draft(tiny_model("qwen2", 0, **PACKABLE), scheme="int4")  # the target's own weights, in int4
    ids = torch.tensor([[5, 9, 11, 4, 7, 3, 21, 8]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    out = target.generate(ids, assistant_model=draft, speculation=GREEDY[method], do_sample=False, max_new_tokens=24,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert calls and out.speculation_stats.mean_tokens_per_step > 1.5  # fused passes ran and their drafts were kept
