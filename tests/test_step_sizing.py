"""Per-step tree sizing: the online acceptance curve and the cost model that decides how far to grow a tree."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_specdec.core.tree import HostTree
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.sizing import HardwareProfile
from hf_specdec.plan.step_sizing import OnlineAcceptance, StepSizer, non_decreasing

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def profile(target_ms, draft_ms) -> HardwareProfile:
    """Latency curves from two functions of n (milliseconds)."""
    curve = lambda f: LatencyCurve(SIZES, tuple(f(n) / 1000 for n in SIZES))  # noqa: E731
    return HardwareProfile(target=curve(target_ms), draft=curve(draft_ms))


def test_acceptance_curve_starts_at_q_and_learns_what_the_target_keeps():
    curve = OnlineAcceptance()
    q = torch.tensor([0.02, 0.3, 0.9]).log()
    start = curve(q).exp()
    assert torch.allclose(start, torch.tensor([0.02, 0.3, 0.9]), rtol=0.6)  # the prior: a calibrated draft
    for _ in range(200):  # the target keeps every token the draft gives 0.3 or 0.9, none of those it gives 0.02
        curve.update([math.log(0.02), math.log(0.3), math.log(0.9)], [False, True, True])
    learned = curve(q).exp()
    assert learned[0] < 0.01 and learned[1] > 0.9 and learned[2] >= learned[1]
    assert curve(torch.tensor([-math.inf])).item() == -math.inf  # a banned token stays impossible
    host = [math.log(0.02), math.log(0.3), math.log(0.9), -math.inf, 0.5]  # the host reading bins the same way
    assert curve.log_rates(host) == curve(torch.tensor(host, dtype=torch.float64)).tolist()


def test_acceptance_curve_out_of_order_pools_neighbours_by_their_trials():
    """Read as non-decreasing in q (a likelier token never rates lower), but by pooling: a bin the target contradicts
    200 times is not lifted to the prior of a neighbour never visited (a draft sure of tokens the target rejects
    would rate near 1 and draft on), and two visited bins out of order meet at their pooled rate."""
    curve = OnlineAcceptance()
    for _ in range(200):  # the draft gives 0.999 and is always wrong
        curve.update([math.log(0.999)], [False])
    sure = curve(torch.tensor([math.log(0.999)])).exp().item()
    assert sure < 0.15
    rates = curve.rates()
    assert all(rates[1:] >= rates[:-1])
    curve = OnlineAcceptance(prior_weight=1e-9)
    for _ in range(100):  # kept at 0.3, never at 0.9: both rate as their pooled trials
        curve.update([math.log(0.3), math.log(0.9)], [True, False])
    assert curve(torch.tensor([0.3, 0.9]).log()).exp().tolist() == pytest.approx([0.5, 0.5], abs=1e-6)


def test_non_decreasing_is_weighted_isotonic_regression():
    from scipy.optimize import isotonic_regression  # a test dependency: the reference implementation

    generator = np.random.default_rng(0)
    for _ in range(50):
        values, weights = generator.random(21), generator.random(21) * 10 + 0.1
        assert np.allclose(non_decreasing(values, weights), isotonic_regression(values, weights=weights).x)


def test_acceptance_curve_tells_confident_tokens_apart():
    """A confident draft gives most tokens q > 0.9: a q = 0.99 token the target keeps 99 times in 100 must rate
    above a q = 0.6 one it keeps 6 times in 10 (one bin over q in [0.56, 1] rated them alike), and before any
    observation the prior tells them apart too."""
    curve = OnlineAcceptance()
    q = torch.tensor([0.6, 0.9, 0.99, 0.999]).log()
    prior = curve(q).exp()
    assert torch.all(prior[1:] > prior[:-1])
    assert torch.allclose(prior, q.exp(), atol=0.06)
    for i in range(400):
        curve.update([math.log(0.6), math.log(0.99)], [i % 10 < 6, i % 100 != 0])
    sure, unsure = curve(torch.tensor([math.log(0.99)])).exp().item(), curve(torch.tensor([math.log(0.6)])).exp().item()
    assert sure > 0.97 and unsure < 0.65
    assert curve.log_rates([math.log(0.99), math.log(0.6)]) == pytest.approx([math.log(sure), math.log(unsure)])


def test_best_prefix_trades_expected_tokens_against_target_time():
    values = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.05, 0.01])
    flat = StepSizer(profile(lambda n: 100.0, lambda n: 10.0))
    assert flat.best_size(values, 0.0)[0] == 7  # every node is free: take them all (root included)
    steep = StepSizer(profile(lambda n: 100.0 * n, lambda n: 10.0))
    assert steep.best_size(values, 0.0)[0] == 1  # each node costs a whole pass: the root alone
    mild = StepSizer(profile(lambda n: 100.0 + 10.0 * n, lambda n: 10.0))
    size, per_token = mild.best_size(values, 0.0)
    assert size == 4  # the three likely nodes pay for their 10 ms, the unlikely ones do not
    assert per_token == pytest.approx((0.1 + 0.01 * 4) / (1 + 0.9 + 0.8 + 0.7))


def test_another_pass_only_when_it_is_predicted_to_pay():
    values = torch.tensor([0.9])
    open_values = torch.tensor([0.9, 0.05])
    cheap_draft = StepSizer(profile(lambda n: 100.0, lambda n: 5.0), expansion_gain=0.8)
    assert cheap_draft.next_frontier(values, open_values, 0.01) >= 1
    costly_draft = StepSizer(profile(lambda n: 100.0, lambda n: 500.0), expansion_gain=0.8)
    assert costly_draft.next_frontier(values, open_values, 0.01) == 0
    unsure = StepSizer(profile(lambda n: 100.0, lambda n: 5.0), expansion_gain=0.8)
    assert unsure.next_frontier(torch.tensor([0.02]), torch.tensor([0.02, 0.01]), 0.01) == 0


def test_trees_stop_at_the_largest_measured_size():
    """Past the target's measured curve a pass's cost is extrapolated; a flat curve (a GPU's, launch-bound) would
    price any tree as free, so trees never outgrow what was measured."""
    short = LatencyCurve((1, 16, 64, 128), (0.02, 0.02, 0.02, 0.02))
    cheap = LatencyCurve((1, 16, 64, 128), (1e-5, 1e-5, 1e-5, 1e-5))
    sizer = StepSizer(HardwareProfile(target=short, draft=cheap), expansion_gain=0.9)
    values = torch.full((500,), 0.5)
    assert sizer.best_size(values, 0.0)[0] == 128  # everything looks free, the cap holds
    assert sizer.next_frontier(values[:126], torch.full((8,), 0.5), 0.0) == 1  # room for one more node: one
    assert sizer.next_frontier(values[:100], torch.full((64,), 0.5), 0.0) == 27  # 101 nodes: 27 fit the curve
    assert sizer.next_frontier(values[:127], torch.full((8,), 0.5), 0.0) == 0  # the tree fills the curve: stop
    longer = StepSizer(profile(lambda n: 100.0, lambda n: 5.0))
    assert longer.best_size(values, 0.0)[0] == 501  # measured to 1024: the cap is not in the way


def test_expansion_gain_follows_what_expansions_add():
    sizer = StepSizer(profile(lambda n: 100.0, lambda n: 5.0), expansion_gain=0.5)
    for _ in range(100):
        sizer.observe_expansion(0.5 + 0.25, 0.4 + 0.05 + 0.2 + 0.025)
    assert abs(sizer.expansion_gain - 0.9) < 1e-3


def test_latency_curves_are_corrected_by_measured_passes():
    """A curve measured on a busy machine (10x too slow here) stops steering the trees after a few steps."""
    stale = StepSizer(profile(lambda n: 1000.0 + 100.0 * n, lambda n: 50.0))
    values = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])
    assert stale.best_size(values, 0.0)[0] == 6  # a flat, costly target: verify everything
    for _ in range(20):  # what the passes really take: 100 ms + 10 ms per token, drafts 5 ms
        stale.observe_target(8, (100.0 + 10.0 * 8) / 1000)
        stale.observe_draft(4, 0.005)
    assert stale.target_scale == pytest.approx(0.1, rel=0.05) and stale.draft_scale == pytest.approx(0.1, rel=0.05)
    assert stale.target_seconds(8) == pytest.approx(0.18, rel=0.05)


def test_bucketed_menus_keep_the_fastest_shape_of_each_size_bucket():
    """A captured call's menu (`shape_sizing.bucketed`): the root alone and, per bucket of `CAPTURED_SIZES`, the shape
    of the full menu predicted fastest per token among those of more nodes than the bucket before and at most its
    own; a cheaper draft moves the picks to deeper shapes."""
    from hf_specdec.methods.sequoia.sizing import sequoia_menu
    from hf_specdec.plan.shape_sizing import CAPTURED_SIZES, RankAcceptance, bucketed

    acceptance = [0.7, 0.15, 0.05, 0.02]
    menu = sequoia_menu(acceptance, 64, 10)
    ranks = RankAcceptance(acceptance, menu.width)
    picks = {}
    for name, draft_ms in (("cheap", 1.0), ("costly", 40.0)):
        sizer = StepSizer(profile(lambda n: 100.0 + n, lambda n, ms=draft_ms: ms))
        cut = bucketed(menu, sizer, ranks)
        per_token = menu.seconds_per_token(sizer, ranks)
        sizes = [len(shape) for shape in cut.shapes]
        assert cut.shapes[0] == [-1] and len(cut.shapes) == len(CAPTURED_SIZES) + 1
        for low, high, shape in zip((1, *CAPTURED_SIZES), CAPTURED_SIZES, cut.shapes[1:]):
            assert low < len(shape) <= high, sizes
            inside = [i for i, s in enumerate(menu.shapes) if low < len(s) <= high]
            assert per_token[menu.shapes.index(shape)] == pytest.approx(min(per_token[i] for i in inside))
        picks[name] = [max(HostTree(parents=shape).depths()) for shape in cut.shapes[1:]]
    assert sum(picks["cheap"]) > sum(picks["costly"]), picks
