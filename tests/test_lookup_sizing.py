"""Prompt-lookup trees sized every step (methods/prompt_lookup/sizing.py): what the cost model learns, what it cuts."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.core.verdict import Verdict
from hf_specdec.methods.prompt_lookup.drafter import PromptLookupDrafter
from hf_specdec.methods.prompt_lookup.sizing import LookupSizer, PassSlope, learned_sizer
from hf_specdec.plan.shape_sizing import PROBE_AFTER
from tests.conftest import random_prompt


@pytest.mark.parametrize("slope", [0.0, 0.03, 0.2])
def test_pass_slope_is_fitted_from_measured_passes(slope):
    fit = PassSlope(prior_slope=0.5)
    for n in [1, 4, 1, 16, 2, 9, 1, 32] * 3:
        fit.observe(n, 0.08 * (1 + slope * (n - 1)))
    assert fit.slope == pytest.approx(slope, abs=1e-6)


def test_pass_slope_keeps_its_prior_until_two_sizes_are_seen():
    fit = PassSlope(prior_slope=0.07)
    for _ in range(5):
        fit.observe(8, 0.2)
    assert fit.slope == 0.07
    fit.observe(0, float("nan"))  # an unusable timing changes nothing
    assert fit.slope == 0.07


def test_best_size_grows_with_acceptance_and_shrinks_with_the_pass_cost():
    sizer = LookupSizer(slope=PassSlope(prior_slope=0.03))
    assert sizer.best_size([0.99 ** k for k in range(1, 20)]) == 20  # a sure chain: every node pays
    assert sizer.best_size([0.01] * 19) == 1  # nothing pays: a plain step
    sizer.slope = PassSlope(prior_slope=0.3)
    assert 1 < sizer.best_size([0.9 ** k for k in range(1, 20)]) < 20


def test_values_multiply_down_the_path_and_learn_from_verdicts():
    sizer = LookupSizer()
    parents, shares = [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0]
    values = sizer.values(parents, shares)
    assert values[0] == 1.0 and values[1] >= values[2] >= values[3] > 0
    for _ in range(40):  # the match's first token is always refused
        sizer.learn(parents, shares, [0])
    assert sizer.values(parents, shares)[1] < 0.1 * values[1]
    minority = [1.0, 0.3, 1.0, 1.0]
    assert sizer.values(parents, minority)[1] == LookupSizer().values(parents, minority)[1]  # not taught


def _loop_tokens(length: int) -> list[int]:
    return [5, 6, 7, 8] * (length // 4)


def test_sized_drafter_cuts_refused_trees_to_plain_steps_and_probes_again():
    drafter = PromptLookupDrafter(sizer=LookupSizer())
    ids = torch.tensor([_loop_tokens(40)])
    full = PromptLookupDrafter().propose(ids)
    sizes = []
    for _ in range(40):
        tree = drafter.propose(ids)
        sizes.append(len(tree))
        drafter.observe_target_pass(len(tree), 0.1 * (1 + 0.2 * (len(tree) - 1)))  # a costly pass per token
        drafter.accept(ids, tree, Verdict(path=[0], bonus_token=99, accepted_ranks=[]))
    assert sizes[0] == len(full) > 1  # before any verdict: the whole tree
    assert sizes.count(1) >= 30  # refused every time: plain steps
    assert sizes[: sizes.index(1)] == sorted(sizes[: sizes.index(1)], reverse=True)  # shrinking as it learns
    first_plain = sizes.index(1)
    probes = [i for i in range(first_plain, len(sizes)) if sizes[i] > 1]
    assert probes and all(sizes[i] == len(full) for i in probes)  # probes offer the whole tree again
    assert probes[0] - first_plain >= PROBE_AFTER  # ... after PROBE_AFTER plain choices, not sooner


def test_sized_drafter_keeps_connected_trees_the_target_accepts():
    drafter = PromptLookupDrafter(sizer=LookupSizer(), max_nodes=12)
    generator = torch.Generator().manual_seed(3)
    ids = torch.cat([random_prompt(generator, 30), random_prompt(generator, 30)[:, :3].repeat(1, 5)], dim=1)
    for _ in range(20):
        tree = drafter.propose(ids)
        parents = tree.parents.tolist()
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        drafter.observe_target_pass(len(tree), 0.1 * (1 + 0.03 * (len(tree) - 1)))
        path = [0]
        while (kids := [i for i, p in enumerate(parents) if p == path[-1]]):
            path.append(kids[0])  # the target keeps every first child
        drafter.accept(ids, tree, Verdict(path=path, bonus_token=1, accepted_ranks=[0] * (len(path) - 1)))
    assert len(tree) > 2  # accepted trees are not cut to plain steps


def test_what_a_call_learns_carries_over_to_the_next_call(tiny_pair):
    target, _ = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(9), 8)  # tiny random models fall into loops: lookups happen
    sizer = learned_sizer(target)
    before = sizer.trials.sum()
    target.generate(ids, speculation="prompt_lookup", do_sample=False, max_new_tokens=40)
    assert learned_sizer(target) is sizer and sizer.trials.sum() > before
    learned = sizer.trials.sum()
    target.generate(ids, speculation="prompt_lookup", speculation_config={"sized": False}, do_sample=False,
                    max_new_tokens=40)
    assert sizer.trials.sum() == learned  # the whole trees, unsized, teach nothing
