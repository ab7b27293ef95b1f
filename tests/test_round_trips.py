"""Host round trips per speculative step: at most the step's draft passes + 2 (the verdict and the stopping check).

Counted on CPU by tests/roundtrips.py (every read of a tensor's values outside the models' own forward passes, a
bound on the syncs a GPU run makes). The step where a stopping criterion fires inside the accepted block checks the
block token by token, as plain generate would, so it may read once more per token of that block; the first step
copies the prompt to the drafter's host copy, once.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, StagedConfig, TokenTree, TreeConfig
from hf_specdec.core.tree import HostTree
from hf_specdec.draft.sized_shape import SizedShapeDrafter
from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.plan.shape_sizing import ShapeChooser
from hf_specdec.verify.greedy import GreedyVerifier
from hf_specdec.verify.sampling import SequoiaVerifier, TargetSampleVerifier
from tests.conftest import random_prompt
from tests.helpers.methods import GREEDY
from tests.roundtrips import count_round_trips

#: per-step sizing on: sequoia's looked-up plan (made online here), specexec and chain at their defaults
SIZED = {"sequoia": SequoiaConfig(), "specexec": SpecExecConfig(), "chain": ChainConfig()}


@pytest.mark.parametrize("name", sorted(GREEDY))
def test_greedy_step_reads_at_most_draft_passes_plus_two(tiny_pair, name, monkeypatch):
    """Greedy verification in its one-read mode, as off the CPU (`GreedyVerifier.stop_early`)."""
    monkeypatch.setattr(GreedyVerifier, "stop_early", False)
    check_greedy(*tiny_pair, GREEDY[name], name)


@pytest.mark.parametrize("name", sorted(GREEDY))
def test_greedy_walk_on_cpu_reads_once_per_node_it_reaches(tiny_pair, name):
    """On CPU the greedy walk computes and reads the argmax of each node it reaches: at most the step's draft passes
    + its emitted tokens (accepted + bonus, one argmax each) + 1 for the stopping check."""
    check_greedy(*tiny_pair, GREEDY[name], name, per_emitted=True)


@pytest.mark.parametrize("name", sorted(SIZED))
def test_greedy_step_sized_every_step_reads_at_most_draft_passes_plus_two(tiny_pair, name, tmp_path, monkeypatch):
    """The cost model's numbers stay host floats: sizing a step reads nothing more. The plan is calibrated in this
    test's own folder: plans are keyed by the models' shapes, and one another test stored for a same-shaped tiny
    model with another draft starts the sizing elsewhere (its first step read once more)."""
    from hf_specdec.methods.sequoia import store

    monkeypatch.setattr(store, "user_plan_dir", lambda: tmp_path)
    monkeypatch.setattr(GreedyVerifier, "stop_early", False)
    check_greedy(*tiny_pair, SIZED[name], name)


def check_greedy(target, draft, config, name, per_emitted: bool = False):
    for seed, prompt_length in ((0, 5), (1, 60)):  # the prefix is never copied back: a long prompt costs no more
        ids = random_prompt(torch.Generator().manual_seed(seed), prompt_length)
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        with count_round_trips(target, draft) as counts:
            out = target.generate(ids, assistant_model=draft, speculation=config, max_new_tokens=30,
                                  do_sample=False)
        assert torch.equal(out, expected)
        first, *steps, last = counts.steps
        assert len(counts.steps) == counts.target_passes + counts.passless > 2
        for step in steps:
            bound = step.draft_passes + (1 + step.emitted if per_emitted else 2)
            assert step.reads <= bound, (name, [(s.reads, s.draft_passes, s.emitted) for s in counts.steps])
        if per_emitted:
            return
        assert first.reads <= first.draft_passes + 3  # + the prompt, copied to the host once
        assert last.reads <= last.draft_passes + 2 + GREEDY_DEPTH_LIMIT


GREEDY_DEPTH_LIMIT = 13  # the deepest accepted block above + its bonus token: the stopping step's token-by-token checks

SAMPLED = {
    "chain": ChainConfig(num_draft_tokens=4, confidence_threshold=0.4),
    "tree": TreeConfig(widths=[3, 2]),
    "sequoia": SequoiaConfig(plan=plan_tree([0.6, 0.2, 0.1, 0.05], 32, 6)),
    # verified by target sampling, a walk on the device (verify/sampling.py, TargetWalk)
    "specexec": SpecExecConfig(budget=32, max_depth=6, width=4),
    "staged": StagedConfig(budget=32, max_depth=6),
}
TARGET_SAMPLED = ("specexec", "staged")


def sampled_steps(tiny_pair, name):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(3), 6)
    torch.manual_seed(0)
    with count_round_trips(target, draft) as counts:
        target.generate(ids, assistant_model=draft, speculation=SAMPLED[name], max_new_tokens=30, do_sample=True,
                        temperature=0.7, top_k=50, top_p=0.9)
    first, *steps, last = counts.steps
    assert len(counts.steps) > 2 and sum(step.draft_passes for step in steps) > 0
    return steps


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_step_reads_at_most_draft_passes_plus_two(tiny_pair, name, monkeypatch):
    """Residual verification decides each visited node in one read and draws a leaf's bonus token with its parent's
    decision; target sampling walks every level on the device and reads once, as it does off the CPU
    (`TargetSampleVerifier.stop_early`). Either way a step reads at most once per draft pass + 2. The target's rows
    are narrowed (top-p in linear time), their flags read with those outcomes: no read of their own."""
    monkeypatch.setattr(TargetSampleVerifier, "stop_early", False)
    steps = sampled_steps(tiny_pair, name)
    for step in steps:
        assert step.reads <= step.draft_passes + 2, (name, [(s.reads, s.draft_passes) for s in steps])


@pytest.mark.parametrize("name", TARGET_SAMPLED)
def test_sampled_target_walk_on_cpu_reads_once_per_level_it_reaches(tiny_pair, name):
    """On CPU (a read waits for nothing) the walk reads after each level and stops where it ends: at most its
    emitted tokens (accepted + bonus) + 1 for the stopping check."""
    steps = sampled_steps(tiny_pair, name)
    for step in steps:
        assert step.reads <= step.draft_passes + 1 + step.emitted, (name, [(s.reads, s.draft_passes, s.emitted)
                                                                           for s in steps])


def test_greedy_verifier_follows_the_first_drafted_of_repeated_siblings():
    """Siblings repeating a token: the walk takes the first-drafted one, even when the other's subtree goes deeper."""
    # root -> a(5), b(5); b -> c(7); a has no children. Target argmax: 5 after the root, 7 after any 5.
    tree = TokenTree.from_parents([1, 5, 5, 7], [-1, 0, 0, 2])
    scores = torch.full((4, 10), -1.0)
    scores[0, 5] = scores[1, 7] = scores[2, 7] = scores[3, 3] = 1.0
    verdict = GreedyVerifier().verify(tree, scores)
    assert verdict.path == [0, 1] and verdict.bonus_token == 7 and verdict.accepted_ranks == [0]
    deeper = TokenTree.from_parents([1, 4, 5, 7], [-1, 0, 0, 2])  # now only b matches: its subtree is followed
    verdict = GreedyVerifier().verify(deeper, scores)
    assert verdict.path == [0, 2, 3] and verdict.bonus_token == 3 and verdict.accepted_ranks == [1, 0]


def test_greedy_walk_on_cpu_takes_the_argmax_of_the_nodes_it_reaches_only(monkeypatch):
    """root -> a(5) -> c(7), root -> b(6): the target keeps a, then stops below it; b and c are never argmaxed. In
    the one-read mode (off the CPU) every row is, at once."""
    from hf_specdec.verify import greedy

    rows = []
    monkeypatch.setattr(greedy, "row_argmax", lambda scores: rows.append(len(scores)) or scores.argmax(-1))
    tree = TokenTree.from_parents([1, 5, 6, 7], [-1, 0, 0, 1])
    scores = torch.full((4, 10), -1.0)
    scores[0, 5] = scores[1, 2] = scores[2, 6] = scores[3, 6] = 1.0
    verdict = GreedyVerifier().verify(tree, scores)
    assert verdict.path == [0, 1] and verdict.bonus_token == 2 and rows == [1, 1]
    rows.clear()
    monkeypatch.setattr(GreedyVerifier, "stop_early", False)
    assert GreedyVerifier().verify(tree, scores) == verdict and rows == [4]


BATCH_PADS = [0, 3, 5, 1]  # left pads of the batch's rows (the first `rows` of them)


def batch_counts(target, draft, config, rows: int, **call):
    """Round trips of one batch call of `rows` prompts (left-padded), checked against plain batched generate."""
    from tests.helpers.batches import padded_batch

    ids, mask = padded_batch(rows, BATCH_PADS[:rows])
    kwargs = dict(attention_mask=mask, max_new_tokens=30, **call)
    torch.manual_seed(0)
    expected = target.generate(ids, **kwargs)
    torch.manual_seed(0)
    with count_round_trips(target, draft) as counts:
        out = target.generate(ids, assistant_model=draft, speculation=config, **kwargs)
    return counts, expected, out


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("name", ["chain", "tree", "sequoia"])
def test_greedy_batch_step_reads_at_most_draft_passes_plus_two(tiny_pair, name, rows):
    """A batch step reads the drafted tokens of every row once (the lockstep drafter), every row's verdict in one
    transfer and every row's stopping check in another: the single sequence's bound whatever the batch size, the
    steps where rows finish (at the length limit, which the host foresees) and the returned cache included."""
    from tests.helpers.batches import near_draft

    target = tiny_pair[0]
    counts, expected, out = batch_counts(target, near_draft(target), GREEDY[name], rows, do_sample=False,
                                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(counts.steps) == counts.target_passes > 2
    first, *steps = counts.steps
    assert sum(step.draft_passes for step in counts.steps) > 0
    for step in steps:
        assert step.reads <= step.draft_passes + 2, (name, rows, [(s.reads, s.draft_passes) for s in counts.steps])
    assert first.reads <= first.draft_passes + 2 + (rows == 1)  # one sequence: its prompt copied to the host once


@pytest.mark.parametrize("one_read", [True, False], ids=["one-read", "cpu"])
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_batch_step_reads_once_per_row_plus_two(tiny_pair, name, rows, one_read, monkeypatch):
    """Sampled rows are verified one after another, each walk reading as a single sequence's does: once, in the
    one-read mode of off the CPU; on a CPU once per level it reaches (at most the lockstep drafter's passes + 1, the
    level of the leaf it ends on). SpecExec's and staged's row drafters grow their trees best first, reading once
    per draft pass. A plain batched step, which the batch's guard runs once per row count to measure
    plain decoding, draws each row's token with one read; the drafted tokens and the stopping checks stay one read
    each for the whole batch."""
    from tests.helpers.batches import near_draft

    if one_read:
        monkeypatch.setattr(TargetSampleVerifier, "stop_early", False)
        monkeypatch.setattr(SequoiaVerifier, "stop_early", False)
    target = tiny_pair[0]
    counts, _, out = batch_counts(target, near_draft(target), SAMPLED[name], rows, do_sample=True,
                                  temperature=0.7, top_k=50, top_p=0.9)
    assert out.shape[0] == rows and len(counts.steps) == counts.target_passes > 2
    for index, step in enumerate(counts.steps):
        growth = step.draft_passes if name in TARGET_SAMPLED else 0  # best-first growth reads once per draft pass
        growth += rows if name in TARGET_SAMPLED and index == 0 else 0  # each row drafter's prompt, copied once
        walks = rows if one_read else rows * (max(step.draft_passes, 1) + 1)
        assert step.reads <= growth + walks + 2, (name, rows, [(s.reads, s.draft_passes) for s in counts.steps])
    # the guard's measured plain steps: one per row count the batch ran at (rows finish), to judge those rows by
    assert sum(step.draft_passes == 0 for step in counts.steps) <= rows


#: fixed-shape trees of several levels: what a captured step drafts (issue 72)
FIXED_SHAPES = {
    "chain": ChainConfig(num_draft_tokens=4, confidence_threshold=0),
    "tree": TreeConfig(widths=[3, 2]),
    "sequoia": SequoiaConfig(plan=plan_tree([0.6, 0.2, 0.1, 0.05], 16, 6)),
}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", sorted(FIXED_SHAPES))
def test_a_fixed_shape_step_on_a_static_cache_reads_once_whatever_its_levels(qwen2_pair, name, sampled, monkeypatch):
    """A step of a fixed-shape method on a static cache, its verifier in its one-read mode (as off the CPU): one
    read, the verdict's (the drafted tokens with it), however many levels the draft and the walk run (greedy;
    recursive rejection sampling walks every level on the device, reading once at its end)."""
    monkeypatch.setattr(GreedyVerifier, "stop_early", False)
    monkeypatch.setattr(SequoiaVerifier, "stop_early", False)
    target = qwen2_pair[0]
    draft = copy.deepcopy(target)  # every draft accepted: the steps run the plan's full depth
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    call = dict(max_new_tokens=30, cache_implementation="static",
                **(dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9) if sampled else dict(do_sample=False)))
    torch.manual_seed(0)
    expected = target.generate(ids, **call)
    torch.manual_seed(0)
    with count_round_trips(target, draft) as counts:
        out = target.generate(ids, assistant_model=draft, speculation=FIXED_SHAPES[name],
                              speculation_config={"guard": False}, **call)
    if not sampled:
        assert torch.equal(out, expected)
    first, *steps, last = counts.steps
    assert steps and all(step.draft_passes >= 2 for step in steps)  # several levels drafted every step
    assert all(step.reads == 1 for step in steps), (name, [(s.reads, s.draft_passes) for s in counts.steps])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_fixed_shape_with_nodes_the_draft_cannot_fill_keeps_them_unread_and_never_accepts_them(qwen2_pair, sampled,
                                                                                              monkeypatch):
    """Two tokens allowed at every position (`prefix_allowed_tokens_fn`) under a tree three children wide: each
    root's third child has no candidate. Unread, the tree keeps its shape with that node as -1 (fed as token 0,
    which the processors forbid here, so accepting it would show); the step still reads once, greedy output is
    plain's, and only filled nodes count as drafted."""
    monkeypatch.setattr(GreedyVerifier, "stop_early", False)
    monkeypatch.setattr(SequoiaVerifier, "stop_early", False)
    target = qwen2_pair[0]
    draft = copy.deepcopy(target)
    ids = random_prompt(torch.Generator().manual_seed(6), 8)
    allowed = [5, 9]
    call = dict(max_new_tokens=20, cache_implementation="static", prefix_allowed_tokens_fn=lambda batch, seq: allowed,
                **(dict(do_sample=True, temperature=0.7) if sampled else dict(do_sample=False)))
    expected = target.generate(ids, **call)
    with count_round_trips(target, draft) as counts:
        out = target.generate(ids, assistant_model=draft, speculation=TreeConfig(widths=[3, 2]),
                              speculation_config={"guard": False}, return_dict_in_generate=True, **call)
    new = out.sequences[0, ids.shape[1]:].tolist()
    assert set(new) <= set(allowed)
    if not sampled:
        assert torch.equal(out.sequences, expected)
    first, *steps, last = counts.steps
    assert steps and all(step.reads == 1 for step in steps), [(s.reads, s.draft_passes) for s in counts.steps]
    stats = out.speculation_stats
    # the shape's 9 drafted nodes (3 + 3 x 2): 2 + 2 x 2 fillable with two tokens allowed
    assert stats.drafted_tokens == 6 * stats.target_forwards


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_sized_sequoia_step_drafted_whole_on_a_static_cache_reads_twice(qwen2_pair, sampled, tmp_path, monkeypatch):
    """`sequoia` at its defaults (a shape of its menu chosen every step) with its early stop off, as off the CPU
    (`SizedShapeDrafter.stop_early`): the chosen shape drafted whole with no read, the verdict's read (the tokens
    with it), then one read of what the step teaches (the draft's probabilities): two, however many levels. Per level
    (the CPU's default) it reads before each level's pass instead."""
    from hf_specdec.methods.sequoia import store

    monkeypatch.setattr(store, "user_plan_dir", lambda: tmp_path)
    monkeypatch.setattr(GreedyVerifier, "stop_early", False)
    monkeypatch.setattr(SequoiaVerifier, "stop_early", False)
    monkeypatch.setattr(SizedShapeDrafter, "stop_early", False)
    # the menu's deepest shape every step (the choice follows this machine's measured curves otherwise)
    monkeypatch.setattr(ShapeChooser, "choose", lambda self, sizer, acceptance: max(
        range(len(self.menu.shapes)), key=lambda index: max(HostTree(parents=self.menu.shapes[index]).depths())))
    target = qwen2_pair[0]
    draft = copy.deepcopy(target)
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    call = dict(max_new_tokens=30, cache_implementation="static",
                **(dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9) if sampled else dict(do_sample=False)))
    expected = target.generate(ids, **call)
    with count_round_trips(target, draft) as counts:
        out = target.generate(ids, assistant_model=draft, speculation="sequoia", speculation_config={"guard": False},
                              return_dict_in_generate=True, **call)
    if not sampled:
        assert torch.equal(out.sequences, expected)
    first, *steps, last = counts.steps
    assert all(step.draft_passes >= 3 for step in steps)  # several levels drafted
    assert all(step.reads <= 2 for step in steps), [(s.reads, s.draft_passes) for s in counts.steps]
    assert out.speculation_stats.draft_pass_sizes  # the level passes were timed and learnt from
