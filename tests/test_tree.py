"""TokenTree: structure, masks and positions, and tree logits equal to causal logits on real architectures."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_specdec import TokenTree
from hf_specdec.core.releases import cache_arg
from hf_specdec.runtime.pass_shapes import depth_first
from tests.conftest import VOCAB, tiny_model


@st.composite
def random_trees(draw, max_nodes: int = 24):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    # BFS order is not required by the math, only parents[i] < i; sort to BFS to match drafters' output.
    tokens = draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n))
    return TokenTree.from_parents(tokens, parents)


@given(random_trees())
def test_depths_and_ancestors_match_walking_up(tree: TokenTree):
    for node in range(len(tree)):
        path = tree.path_to(node)
        assert path[0] == 0 and path[-1] == node
        assert int(tree.depths[node]) == len(path) - 1
        assert set(torch.nonzero(tree.ancestors[node]).flatten().tolist()) == set(path)


def test_rejects_malformed_parents():
    with pytest.raises(ValueError, match="root"):
        TokenTree.from_parents([5, 6], [0, -1])
    with pytest.raises(ValueError, match="parents"):
        TokenTree.from_parents([5, 6, 7], [-1, 2, 0])


def test_mask_is_additive_float_with_dtype_min():
    tree = TokenTree.from_parents([5, 6, 7], [-1, 0, 0])
    mask = tree.attention_mask(past_length=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 3, 5) and mask.dtype == torch.float32
    blocked = torch.finfo(torch.float32).min
    assert (mask[0, 0, :, :2] == 0).all()
    assert mask[0, 0, 1, 4] == blocked and mask[0, 0, 2, 3] == blocked  # siblings never see each other
    assert mask[0, 0, 2, 2] == 0 and mask[0, 0, 2, 4] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@settings(max_examples=25, deadline=None)
@given(tree=random_trees(max_nodes=16), prefix_len=st.integers(1, 12))
def test_tree_logits_equal_causal_path_logits(arch: str, tree: TokenTree, prefix_len: int):
    model = _model(arch)
    prefix = torch.arange(prefix_len)[None] % (VOCAB - 3) + 3
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, **cache_arg(cache))
        logits = model(
            tree.tokens[None],
            attention_mask=tree.attention_mask(prefix_len, torch.float32),
            position_ids=tree.position_ids(prefix_len),
            **cache_arg(cache),
        ).logits[0]
        for node in range(len(tree)):
            path = torch.cat([prefix[0], tree.tokens[tree.path_to(node)]])[None]
            expected = model(path).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, atol=1e-5, rtol=1e-5)


_MODELS: dict[str, torch.nn.Module] = {}


def _model(arch: str) -> torch.nn.Module:
    if arch not in _MODELS:
        _MODELS[arch] = tiny_model(arch, 0)
    return _MODELS[arch]


@given(random_trees())
def test_depth_first_keeps_parents_first_and_first_child_paths_consecutive(tree: TokenTree):
    ordered, kept = depth_first(tree, None, torch.device("cuda"))  # a device only names where the target runs
    host, old = ordered.host(tokens=True), tree.host(tokens=True)
    kept = kept if kept is not None else list(range(len(tree)))
    assert sorted(kept) == list(range(len(tree))) and kept[0] == 0
    assert host.tokens == [old.tokens[node] for node in kept]
    assert torch.equal(ordered.tokens, tree.tokens[kept])
    place = {node: i for i, node in enumerate(kept)}
    assert host.parents == [-1] + [place[old.parents[node]] for node in kept[1:]]  # same edges, parents first
    for children in old.children():  # siblings keep their drafting order
        assert [place[child] for child in children] == sorted(place[child] for child in children)
    node, places = 0, [0]  # the path taking the first child at every level: places 0, 1, 2, ...
    while old.children()[node]:
        node = old.children()[node][0]
        places.append(place[node])
    assert places == list(range(len(places)))


def test_depth_first_off_the_cpu_only_unless_set():
    tree = TokenTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1])  # breadth first: 0 -> 1 -> 3 is not consecutive
    assert depth_first(tree, None, torch.device("cpu")) == (tree, None)
    assert depth_first(tree, None, torch.device("cuda"))[1] == [0, 1, 3, 2]
    assert depth_first(tree, [0, 1, 2, 5], torch.device("cuda"))[1] == [0, 1, 5, 2]  # composed with a level cut
    assert depth_first(tree, None, torch.device("cpu"), wanted=True)[0].host().parents == [-1, 0, 1, 0]
    assert depth_first(tree, None, torch.device("cuda"), wanted=False) == (tree, None)
