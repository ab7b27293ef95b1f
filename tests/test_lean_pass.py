"""The draft's lean pass (`draft/lean_pass.py`) computes what the model's own forward computes, on tree masks."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_specdec import TokenTree
from hf_specdec.core.attention import AttentionLayout
from hf_specdec.draft import draft_model
from hf_specdec.draft.draft_model import DraftModelRunner
from hf_specdec.draft.lean_pass import LeanPass
from tests.tiny import SIZES, VOCAB, build, tiny_model

PAIRS = {
    "llama": lambda: tiny_model("llama", 0),
    "qwen2": lambda: tiny_model("qwen2", 0),
    # a window on the first layer only: one mask per layer type, as a dict
    "qwen2 sliding": lambda: tiny_model("qwen2", 0, use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "mistral": lambda: build(transformers.MistralConfig(vocab_size=VOCAB, **SIZES, sliding_window=None)),
    "llama, one key/value head": lambda: tiny_model("llama", 0, num_key_value_heads=1),
}


def assert_lean_pass_equals_the_model(model: torch.nn.Module, keep: int, **tolerance) -> None:
    """On `model`'s device and dtype: the lean pass's logits and cache writes are the model's own, on a tree after a
    cached prefix."""
    device, dtype = model.device, model.dtype
    layout = AttentionLayout.of(model)
    lean = LeanPass.of(model, layout.layer_types)
    assert lean is not None
    prefix = torch.tensor([[5, 9, 11, 4, 7, 3]], device=device)
    tree = TokenTree.from_parents([7, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 3]).to(device)
    past = prefix.shape[1] - 1
    caches = [DynamicCache(), DynamicCache()]
    with torch.no_grad():
        for cache in caches:
            model(prefix[:, :past], past_key_values=cache, use_cache=True)
        masks = layout.tree_masks(tree, past, dtype)
        theirs = model(input_ids=tree.tokens[None], position_ids=tree.position_ids(past), attention_mask=masks,
                       past_key_values=caches[0], use_cache=True).logits
        ours = lean(tree.tokens[None], tree.position_ids(past), masks, caches[1], keep)
    torch.testing.assert_close(ours, theirs[:, -keep:] if keep else theirs, **tolerance)
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(a.keys, b.keys, **tolerance)
        torch.testing.assert_close(a.values, b.values, **tolerance)


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

