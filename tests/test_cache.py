"""KV-cache compaction: keeping an accepted path equals having run that path causally."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from hf_specdec import SequoiaConfig, SpecExecConfig, TokenTree, TreeConfig
from hf_specdec.accept.kv_cache import crop, keep_positions
from hf_specdec.core.releases import cache_arg
from hf_specdec.methods.sequoia.dp import plan_tree
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
        model(prefix, **cache_arg(cache))
        model(
            tree.tokens[None],
            attention_mask=tree.attention_mask(past, torch.float32),
            position_ids=tree.position_ids(past),
            **cache_arg(cache),
        )
        keep_positions(cache, past, [past + i for i in path])
        model(torch.cat([prefix, tree.tokens[path][None]], dim=1), **cache_arg(reference))
    assert cache.get_seq_length() == reference.get_seq_length() == past + len(path)
    for ours, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_crop_drops_the_tail():
    model = tiny_model("llama", 0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9]]), **cache_arg(cache))
    crop(cache, 3)
    assert cache.get_seq_length() == 3


class _CopyOps(TorchDispatchMode):
    """Counts the ops that would move cache rows on a device: gathers (index) and copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("index", "index_select", "copy_", "index_put_", "gather"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "kept, moves",
    [
        ([4, 5, 6], set()),  # in place (a first-child path of a depth-first tree): the tail cut, nothing moved
        ([4, 5, 9, 10], {"copy_"}),  # one run past the kept rows' end: a slice copy per tensor, no gather
        ([4, 6, 7], {"index", "copy_"}),  # a run overlapping where it lands (6, 7 -> 5, 6): gathered first
        ([4, 7, 9], {"index", "copy_"}),  # scattered rows
        ([], set()),
    ],
)
def test_keep_positions_moves_only_rows_out_of_place(kept: list[int], moves: set[str]):
    torch.manual_seed(0)
    cache = DynamicCache()
    layers = [(torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)) for _ in range(3)]
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.clone(), values.clone(), index)
    with _CopyOps() as counted:
        keep_positions(cache, 4, kept)
    assert set(counted.ops) == moves
    rows = list(range(4)) + kept
    for layer, (keys, values) in zip(cache.layers, layers):
        assert torch.equal(layer.keys, keys[:, :, rows]) and torch.equal(layer.values, values[:, :, rows])


@pytest.mark.parametrize("speculation", [
    TreeConfig(widths=[3, 2, 2]),
    SequoiaConfig(plan=plan_tree([0.6, 0.2, 0.1, 0.05], 16, 5)),
    SpecExecConfig(budget=16, max_depth=5, width=3),
], ids=["tree", "sequoia", "specexec"])
def test_target_keeps_first_child_paths_without_moving_rows(speculation, monkeypatch):
    """The target is its own draft, so every step accepts the first child at each level: with the tree in
    depth-first order (`runtime.pass_shapes.depth_first`, off the CPU; set here) the kept rows are already in place,
    and the cache is cut."""
    import hf_specdec.decoding.loop as loop

    speculation = dataclasses.replace(speculation, depth_first=True)  # as off the CPU
    model, calls = tiny_model("qwen2", 0), []

    def recording(cache, start, kept):
        calls.append((start, list(kept)))
        return keep_positions(cache, start, kept)

    monkeypatch.setattr(loop, "keep_positions", recording)
    ids = torch.tensor([[5, 9, 11, 4, 7]])
    out = model.generate(ids, assistant_model=model, speculation=speculation, max_new_tokens=24, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=24, do_sample=False))
    assert any(len(kept) > 2 for _, kept in calls)  # deep paths were accepted
    assert all(kept == list(range(start, start + len(kept))) for start, kept in calls)
