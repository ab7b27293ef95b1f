"""What the engine now decides on the host instead of on the model's device (issues 21 and 26: fewer launches per
step on a GPU): each host decision equals what the device computation it replaced gives, on random cases."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from hf_specdec.accept.emit import BlockStops, emit_rows
from hf_specdec.core.tree import HostTree, TokenTree, additive_mask, renumber_parents
from hf_specdec.draft.shaped_tree import planned_shape
from hf_specdec.methods.sequoia.sizing import sequoia_menu
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.shape_sizing import ShapeDepths
from hf_specdec.plan.shapes import widths_parents
from hf_specdec.plan.sizing import HardwareProfile
from hf_specdec.plan.step_sizing import StepSizer
from hf_specdec.verify.greedy import GreedyVerifier
from tests.conftest import tiny_model
from tests.helpers.batches import near_draft, padded_batch


def random_parents(n: int, generator: np.random.Generator) -> list[int]:
    """A random tree of `n` nodes, each node's parent before it."""
    return [-1] + [int(generator.integers(0, node)) for node in range(1, n)]


def walked_ancestors(parents: list[int]) -> torch.Tensor:
    """The reference: ancestors by walking each node up to the root."""
    out = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        up = node
        while up >= 0:
            out[node, up] = True
            up = parents[up]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_host_structure_is_the_walked_one(seed):
    rng = np.random.default_rng(seed)
    parents = random_parents(int(rng.integers(1, 40)), rng)
    depths, ancestors = HostTree(parents).structure()
    assert torch.equal(ancestors, walked_ancestors(parents))
    assert depths.tolist() == HostTree(parents).depths()
    tree = TokenTree.from_parents(list(range(len(parents))), parents)
    assert torch.equal(tree.ancestors, ancestors) and torch.equal(tree.depths, depths)
    assert torch.equal(HostTree(parents).visibility(3), tree.visibility(3))


@pytest.mark.parametrize("seed", range(10))
def test_a_selected_tree_takes_its_parents_from_the_host_copy(seed):
    rng = np.random.default_rng(seed)
    parents = random_parents(int(rng.integers(2, 30)), rng)
    tree = TokenTree.from_parents(list(range(100, 100 + len(parents))), parents)
    depths = tree.host().depths()
    limit = int(rng.integers(0, max(depths) + 1))
    keep = [node for node, depth in enumerate(depths) if depth <= limit]
    picked = tree.select(keep)
    assert torch.equal(picked.parents, renumber_parents(tree.parents, torch.tensor(keep)))
    assert picked.host().parents == picked.parents.tolist()
    assert picked.tokens.tolist() == [100 + node for node in keep]


def device_greedy_path(tree: TokenTree, scores: torch.Tensor) -> tuple[list[int], int]:
    """The reference walk: descend to the first-drafted child carrying its parent's argmax."""
    best = scores.argmax(-1).tolist()
    children, tokens = tree.host().children(), tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        match = [child for child in children[node] if tokens[child] == best[node]]
        if not match:
            return path, best[node]
        node = match[0]
        path.append(node)


@pytest.mark.parametrize("stop_early", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_the_greedy_walk_on_the_host_accepts_the_first_drafted_match(seed, stop_early, monkeypatch):
    """Both modes (every node's argmax read at once, or the reached nodes' one by one) give the device's verdict;
    wide rows take the block-maximum argmax, whose ties must resolve as `torch.argmax` does."""
    monkeypatch.setattr(GreedyVerifier, "stop_early", stop_early)
    rng = np.random.default_rng(seed)
    parents = random_parents(int(rng.integers(1, 25)), rng)
    vocab = 4 if seed % 2 else 20_000  # narrow rows, or rows wide enough for the block-maximum argmax
    tokens = rng.integers(0, 4, len(parents)).tolist()  # few tokens: siblings repeat tokens, matches are common
    tree = TokenTree.from_parents(tokens, parents)
    scores = torch.randn(len(parents), vocab, generator=torch.Generator().manual_seed(seed))
    if vocab > 4:  # ties at the maximum in the wide rows, the first one among the drafted tokens now and then
        scores[:, 3] = scores[:, 1] = scores.amax(dim=-1) + float(seed % 3)
    verdict = GreedyVerifier().verify(tree, scores)
    path, bonus = device_greedy_path(tree, scores)
    assert verdict.path == path and verdict.bonus_token == bonus
    children = tree.host().children()
    assert verdict.accepted_ranks == [children[p].index(c) for p, c in zip(path, path[1:])]


def test_a_tree_without_host_tokens_gets_them_with_the_argmax():
    tree = TokenTree(tokens=torch.tensor([5, 1, 2, 1]), parents=torch.tensor([-1, 0, 0, 1]))
    scores = torch.full((4, 4), -1.0)
    scores[0, 2], scores[2, 3] = 1.0, 1.0
    verdict = GreedyVerifier().verify(tree, scores)
    assert verdict.path == [0, 2] and verdict.bonus_token == 3 and tree.host().tokens == [5, 1, 2, 1]


CRITERIA = {
    "length": lambda: [MaxLengthCriteria(max_length=9)],
    "eos": lambda: [EosTokenCriteria(eos_token_id=torch.tensor([3, 7]))],
    "both": lambda: [MaxLengthCriteria(max_length=11), EosTokenCriteria(eos_token_id=torch.tensor([2]))],
    "time, not yet": lambda: [MaxTimeCriteria(max_time=60.0), MaxLengthCriteria(max_length=20)],
    "time, passed": lambda: [MaxTimeCriteria(max_time=0.0, initial_timestamp=time.time() - 1.0)],
    "none": lambda: [],
}


@pytest.mark.parametrize("kind", CRITERIA)
@pytest.mark.parametrize("seed", range(8))
def test_stops_decided_on_the_host_equal_transformers_criteria(kind, seed):
    criteria = StoppingCriteriaList(CRITERIA[kind]())
    stops = BlockStops.of(criteria)
    assert stops.on_host
    on_device = BlockStops(stops.monotone, stops.eos, stops.max_length, None)  # the same, read from the device
    rng = np.random.default_rng(seed)
    rows = [(torch.tensor([rng.integers(0, 10, int(rng.integers(3, 8))).tolist()]),
             rng.integers(0, 10, int(rng.integers(1, 6))).tolist(), torch.empty(0, 0)) for _ in range(3)]
    for (ids, length, stop), (ids2, length2, stop2) in zip(emit_rows(rows, criteria, stops),
                                                           emit_rows(rows, criteria, on_device)):
        assert torch.equal(ids, ids2) and length == length2 and stop == stop2


def test_a_criterion_of_another_kind_keeps_the_device_check():
    class Custom(MaxLengthCriteria):
        pass

    assert not BlockStops.of(StoppingCriteriaList([Custom(max_length=5)])).on_host


def test_a_latency_curve_reads_whole_sizes_as_it_interpolates():
    curve = LatencyCurve((1, 4, 16, 64), (0.010, 0.012, 0.020, 0.030))
    sizes = np.arange(1, 200)
    assert [curve(int(n)) for n in sizes] == pytest.approx(curve(sizes.astype(float)).tolist(), rel=0, abs=0)
    assert isinstance(curve(np.int64(7)), float) and curve(7) == curve(7.0)


def loop_best_stop(depths: ShapeDepths, values, drafted, acceptance, sizer) -> int:
    """The node-by-node form `best_stop` had before it went level by level."""
    predicted = np.asarray(values, dtype=float).copy()
    p = np.append(acceptance, 0.0)
    for node in range(1, len(predicted)):
        if depths.depths[node] > drafted:
            predicted[node] = predicted[depths.parents[node]] * p[min(depths.ranks[node], len(p) - 1)]
    stops = np.arange(drafted, len(depths.pass_tokens) + 1)
    within = depths.depths[None, :] <= stops[:, None]
    expected = (within * predicted).sum(1)
    draft = np.cumsum([0.0, *(sizer.draft_seconds(w) for w in depths.pass_tokens)])[stops]
    seconds = draft + sizer.target_seconds(within.sum(1)) + sizer.profile.step_overhead
    return int(stops[np.argmin(seconds / expected)])


@pytest.mark.parametrize("seed", range(25))
def test_best_stop_level_by_level_equals_node_by_node(seed):
    rng = np.random.default_rng(seed)
    parents = random_parents(int(rng.integers(2, 60)), rng)
    depths = ShapeDepths.of(parents)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    profile = HardwareProfile(LatencyCurve(sizes, tuple(0.02 + rng.uniform(0, 1e-3) * s for s in sizes)),
                              LatencyCurve(sizes, tuple(0.004 + rng.uniform(0, 2e-4) * s for s in sizes)))
    sizer = StepSizer(profile)
    acceptance = np.sort(rng.uniform(0, 0.9, int(rng.integers(1, 6))))[::-1]
    for drafted in range(max(depths.depths) + 1):
        values = [1.0] + rng.uniform(0, 1, len(parents) - 1).tolist()
        assert depths.best_stop(values, drafted, acceptance, sizer) == loop_best_stop(
            depths, values, drafted, acceptance, sizer)


def test_the_sequoia_menu_and_planned_shapes_are_built_once():
    acceptance = [0.7, 0.2, 0.05]
    assert sequoia_menu(acceptance, 16, 6) is sequoia_menu(list(acceptance), 16, 6)
    first = planned_shape((-1, 0, 0, 1), torch.device("cpu"))
    assert planned_shape((-1, 0, 0, 1), torch.device("cpu")) is first
    host, tree, levels, slot_of = first
    assert [level.parent_list for level in levels] == [[0], [1]] and slot_of == [-1, 0, -1, -1]
    assert levels[1].sees.device.type == "cpu" and levels[1].depths.tolist() == [1]
    assert torch.equal(additive_mask(host.visibility(2), torch.float32), additive_mask(tree.visibility(2),
                                                                                      torch.float32))


def test_decoding_never_writes_into_the_shared_shape_levels():
    """`planned_shape` hands every call the same level tensors: a batch in lockstep and a single sequence draft
    from them and leave them as built."""
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(4, [0, 2])
    config = {"speculation": "tree", "speculation_config": {"widths": [2, 2], "guard": False}}
    shape = planned_shape(tuple(widths_parents([2, 2])), torch.device("cpu"))
    before = [(level.sees.clone(), level.depths.clone()) for level in shape[2]]
    target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft, **config)
    target.generate(ids[:1], max_new_tokens=12, do_sample=False, assistant_model=draft, **config)
    assert planned_shape(tuple(widths_parents([2, 2])), torch.device("cpu")) is shape
    for level, (sees, depths) in zip(shape[2], before):
        assert torch.equal(level.sees, sees) and torch.equal(level.depths, depths)
