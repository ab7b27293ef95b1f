"""The Llama-shaped families the lean pass runs, and its check against the model's own forward."""

from __future__ import annotations

import torch
import transformers
from transformers import DynamicCache

from hf_specdec import TokenTree
from hf_specdec.core.releases import cache_arg
from hf_specdec.kernels.lean_pass import LeanPass
from hf_specdec.runtime.attention import AttentionLayout
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
            model(prefix[:, :past], **cache_arg(cache), use_cache=True)
        masks = layout.tree_masks(tree, past, dtype)
        theirs = model(input_ids=tree.tokens[None], position_ids=tree.position_ids(past), attention_mask=masks,
                       **cache_arg(caches[0]), use_cache=True).logits
        ours = lean(tree.tokens[None], tree.position_ids(past), masks, caches[1], keep)
    torch.testing.assert_close(ours, theirs[:, -keep:] if keep else theirs, **tolerance)
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(a.keys, b.keys, **tolerance)
        torch.testing.assert_close(a.values, b.values, **tolerance)
