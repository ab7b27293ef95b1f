"""KV-cache compaction: keeping an accepted path equals having run that path causally."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_specdec import TokenTree
from hf_specdec.accept.kv_cache import crop, keep_positions
from tests.conftest import VOCAB, tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_compacted_cache_equals_causal_cache(arch: str, data):
    model = tiny_model(arch, 0)
    n = data.draw(st.integers(2, 14))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n))
    tree = TokenTree.from_parents(tokens, parents)
    node = data.draw(st.integers(0, n - 1))
    prefix = torch.tensor([[5, 9, 11, 4]])
    past = prefix.shape[1]
    cache = DynamicCache(config=model.config)
    reference = DynamicCache(config=model.config)
    path = tree.path_to(node)
    with torch.no_grad():
        model(prefix, past_key_values=cache)
        model(
            tree.tokens[None],
            attention_mask=tree.attention_mask(past, torch.float32),
            position_ids=tree.position_ids(past),
            past_key_values=cache,
        )
        keep_positions(cache, past, [past + i for i in path])
        model(torch.cat([prefix, tree.tokens[path][None]], dim=1), past_key_values=reference)
    assert cache.get_seq_length() == reference.get_seq_length() == past + len(path)
    for ours, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_crop_drops_the_tail():
    model = tiny_model("llama", 0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9]]), past_key_values=cache)
    crop(cache, 3)
    assert cache.get_seq_length() == 3
