"""`sequoia` and `tree` sized every step, and the guard that turns losing steps plain (issue 23).

End-to-end runs use latency curves given here and no timing corrections (`timing_memory=1`), so what the sizing
chooses depends on acceptance only, never on how fast this machine happens to be.
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest
import torch

import hf_specdec.draft.guarded as guarded
import hf_specdec.integration.generate as integration
import hf_specdec.methods.static_shape as static_shape
from hf_specdec import ChainConfig, SequoiaConfig, TreeConfig
from hf_specdec.draft.shaped_tree import ModelTreeDrafter
from hf_specdec.draft.sized_shape import SizedShapeDrafter
from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.methods.sequoia.plan_file import SequoiaPlan
from hf_specdec.methods.sequoia.sizing import sequoia_menu
from hf_specdec.plan.guard import PlainGuard
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.shape_sizing import (
    SIZE_PROBE_AFTER,
    RankAcceptance,
    ShapeChooser,
    ShapeDepths,
    sub_shapes_menu,
)
from hf_specdec.plan.sizing import HardwareProfile
from hf_specdec.plan.step_sizing import OnlineAcceptance, StepSizer
from tests.conftest import random_prompt, tiny_model

_real_sequence_guard = guarded.sequence_guard  # before the suite's fixture swaps it for an inert one

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
PRIOR = [0.7, 0.1, 0.05]


#: a chain stopped by Transformers' rule, not sized: it speculates whatever the tiny models' timings say
RULED_CHAIN = ChainConfig(confidence_threshold=0.4)


def profile(target_ms: float, draft_ms: float) -> HardwareProfile:
    """Flat latency curves: every pass costs the same whatever its size."""
    curve = lambda ms: LatencyCurve(SIZES, tuple(ms / 1000 for _ in SIZES))  # noqa: E731
    return HardwareProfile(target=curve(target_ms), draft=curve(draft_ms))


# --- the menu and the learned positional acceptance ---------------------------------------------------------
def test_the_menu_grows_with_acceptance_and_falls_to_a_plain_step_without_it():
    menu = sequoia_menu(PRIOR, 32, 6)
    sizer = StepSizer(profile(100.0, 10.0))
    ranks = RankAcceptance(PRIOR, menu.width)
    choice, _ = menu.best(sizer, ranks)
    assert len(menu.shapes[choice]) > 4  # a cheap draft and a likely first child: a real tree
    for _ in range(100):  # the target never keeps a drafted child, below the root or deeper
        ranks.update([3, 3], [None, None], [True, False])
    assert menu.best(sizer, ranks)[0] == 0  # the root alone: a plain step
    for _ in range(300):  # acceptance returns
        ranks.update([3, 3], [0, 0], [True, False])
    grown, _ = menu.best(sizer, ranks)
    assert grown != 0 and max(_depths(menu.shapes[grown])) >= 3


def test_a_draft_as_costly_as_the_target_is_never_predicted_to_pay():
    menu = sequoia_menu(PRIOR, 32, 6)
    assert menu.best(StepSizer(profile(100.0, 100.0)), RankAcceptance(PRIOR, menu.width))[0] == 0


def test_expected_tokens_match_the_planner():
    menu = sequoia_menu(PRIOR, 16, 4)
    expected = menu.expected_tokens(np.array(PRIOR))
    for shape, value in list(zip(menu.shapes, expected))[1:]:
        plan = plan_tree(PRIOR, len(shape), max(_depths(shape)) + 1)
        assert value <= plan.expected_tokens + 1e-9  # no shape of that size and depth beats the DP's
    assert expected[0] == 1.0 and expected.max() > 2.0


def test_acceptance_below_the_root_is_learned_apart_from_deeper():
    """Verdicts where the root's first child is kept and deeper ones are not move the two rows apart; the menu
    prices a shape's first level with one row and the rest with the other."""
    ranks = RankAcceptance(PRIOR, 3)
    children = [[1, 2], [3], [], [4], []]  # root -> 1, 2; 1 -> 3 -> 4
    for _ in range(50):
        ranks.learn(children, [0, 1], [0])  # 1 kept, 3 not
    below_root, deeper = ranks.vectors()
    assert below_root[0] > 0.9 and deeper[0] < 0.2
    menu = sequoia_menu(PRIOR, 8, 4)
    chain = menu.shapes.index([-1, 0, 1])
    expected = menu.expected_tokens(np.array([[0.9, 0.0, 0.0], [0.5, 0.0, 0.0]]))[chain]
    assert expected == pytest.approx(1 + 0.9 + 0.9 * 0.5)


def test_sub_shapes_of_the_default_tree_down_to_a_one_token_chain():
    menu = sub_shapes_menu([4, 2, 1, 1])
    assert menu.shapes[0] == [-1] and [-1, 0] in menu.shapes
    assert max(len(s) for s in menu.shapes) == 1 + 4 + 8 + 8 + 8
    assert len(menu.shapes) == 1 + 4 + 8 + 8 + 8


def test_drafting_stops_where_the_draft_turns_unsure_or_costly():
    """After the root's pass of a 5-chain (one node drafted): a confident first token and a cheap draft draft the
    whole chain; an unsure one, or a draft as costly as the target, stops now."""
    chain = ShapeDepths.of([-1, 0, 1, 2, 3])
    p = np.array([0.9])
    cheap = StepSizer(profile(100.0, 10.0))
    assert chain.best_stop([1.0, 0.95, 0, 0, 0], 1, p, cheap) == 4
    assert chain.best_stop([1.0, 0.02, 0, 0, 0], 1, p, cheap) == 1
    assert chain.best_stop([1.0, 0.95, 0, 0, 0], 1, p, StepSizer(profile(100.0, 100.0))) == 1
    # an acceptance that falls off after two levels: stop in the middle
    assert chain.best_stop([1.0, 0.95, 0, 0, 0], 1, np.array([0.9]), StepSizer(profile(100.0, 60.0))) in (2, 3)


def test_a_tree_larger_than_any_timed_pass_is_drafted_only_as_a_paced_probe():
    """The curves price a big tree best. The call's first tree is a probe; once a 4-node pass is timed, the next
    `SIZE_PROBE_AFTER` steps keep to timed sizes, then one probe of the big tree; once it is timed, no more probes."""
    menu = sequoia_menu(PRIOR, 32, 6)
    sizer, ranks = StepSizer(profile(100.0, 10.0)), RankAcceptance([0.95, 0.02, 0.01], menu.width)
    chooser = ShapeChooser(menu, 32)
    best, _ = menu.best(sizer, ranks)
    big = len(menu.shapes[best])
    assert big > 8
    assert chooser.choose(sizer, ranks) == best and chooser.size_probes == 1
    sizer.observe_target(4, 0.1)  # the probe's pass (cut short after two levels) took 4 nodes
    waited = [chooser.choose(sizer, ranks) for _ in range(SIZE_PROBE_AFTER)]
    assert all(1 < len(menu.shapes[c]) <= 4 for c in waited) and chooser.size_probes == 1
    assert chooser.choose(sizer, ranks) == best and chooser.size_probes == 2
    sizer.observe_target(big, 0.1)
    assert [chooser.choose(sizer, ranks) for _ in range(3)] == [best] * 3 and chooser.size_probes == 2


@pytest.mark.parametrize("method", ["sequoia", "tree"])
def test_a_call_counts_its_size_probes_and_paces_them(given_curves, method, monkeypatch):
    """Through `generate`: every step whose tree is larger than any target pass timed before it is counted in
    `speculation_stats.size_probes`, two such steps lie `SIZE_PROBE_AFTER` steps apart once a tree was timed, and the
    output is plain's."""
    steps, choose = [], ShapeChooser.choose

    def spied(self, sizer, acceptance):
        timed, probes = sizer.largest_timed, self.size_probes
        choice = choose(self, sizer, acceptance)
        steps.append((len(self.menu.shapes[choice]), timed, self.size_probes - probes))
        return choice

    monkeypatch.setattr(ShapeChooser, "choose", spied)
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(3), 9)
    out = _generate(target, target, ids, method, new=48)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=48))
    assert [probe for size, timed, probe in steps] == [int(size > max(timed, 1)) for size, timed, _ in steps]
    probed = [step for step, (_, _, probe) in enumerate(steps) if probe]
    assert probed[0] == 0 and out.speculation_stats.size_probes == len(probed)
    assert out.speculation_stats.as_dict()["size_probes"] == len(probed)
    assert all(later - earlier > SIZE_PROBE_AFTER for earlier, later in zip(probed, probed[1:]))


def _depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


# --- the measured guard ------------------------------------------------------------------------------------
def _step_seconds(kinds: str, spec_seconds: float, first_spec: float | None) -> float:
    """The next step's seconds after `kinds`: a speculative step costs `spec_seconds`, `first_spec` right after a
    plain one if given (its draft catching up); a plain step 1 s."""
    return first_spec if first_spec is not None and kinds.endswith("p") else spec_seconds


def _steps(guard: PlainGuard, count: int, spec_seconds: float, spec_tokens: int, first_spec: float | None = None,
           tree_pass: float = 1.0) -> str:
    """Run `count` steps as the loop does (plain: 1 s a token; a speculative step: a `tree_pass` s target pass over
    its tree, what an unmeasured guard takes for a plain step's cost, and drafting; `spec_tokens` tokens); "p" for
    each plain step, "s" for each speculative one."""
    kinds = ""
    for _ in range(count):
        plain = guard.plain_next()
        seconds = 1.0 if plain else _step_seconds(kinds, spec_seconds, first_spec)
        guard.observe(seconds, 1 if plain else spec_tokens, plain=plain,
                      draft_seconds=0.0 if plain else seconds - tree_pass)
        kinds += "p" if plain else "s"
    return kinds


def _seconds_per_token(kinds: str, spec_seconds: float, spec_tokens: int, first_spec: float | None = None) -> float:
    """What the steps `kinds` (as `_steps` ran them) cost per token."""
    seconds = sum(1.0 if kind == "p" else _step_seconds(kinds[:i], spec_seconds, first_spec)
                  for i, kind in enumerate(kinds))
    return seconds / sum(1 if kind == "p" else spec_tokens for kind in kinds)


def test_the_guard_turns_losing_steps_plain_and_probes_again():
    guard = PlainGuard(patience=2, backoff=2, probe_share=100.0)  # small losses: the doubling backoff decides
    guard.observe(1.0, 1, plain=True)  # plain decoding: 1 s a token
    # 3 s for 2 tokens loses: 2 steps judged, 2 plain; the probe's first step (its draft reads the waited tokens) is
    # not judged, its next 2 are, and still lose: 4 plain
    assert _steps(guard, 11, 3.0, 2) == "ss" + "pp" + "sss" + "pppp"
    assert guard.plain_steps == 6
    assert _steps(guard, 6, 1.0, 4) == "s" * 6  # acceptance returned: 1 s for 4 tokens, speculation stays on


def test_a_probes_wait_repays_its_own_steps_only():
    """The wait after a loss repays what the steps since the last judgement that did not lose cost, not a long
    stretch that ran within the margin before it."""
    guard = PlainGuard()
    guard.observe(1.0, 1, plain=True)
    assert _steps(guard, 100, 2.1, 2) == "s" * 100  # within the margin: 5% over plain, never judged the loser
    _steps(guard, 3, 3.0, 2)
    assert 0 < guard.waiting <= 20  # the 100 steps' 10 s over plain would ask for 100 more


def test_a_probes_first_step_is_repaid_but_not_judged():
    """After a wait, the probe's first step feeds the draft every waited token: its cost is repaid if the probe loses
    (so dear catch-ups still cost at most the probe share), but speculation is not judged by it (a winning draft
    would otherwise be judged the loser after every long wait)."""
    guard = PlainGuard(waiting=4)
    guard.observe(1.0, 1, plain=True)
    assert _steps(guard, 30, 1.0, 4, first_spec=20.0) == "pppp" + "s" * 26  # 1 s for 4 tokens wins
    guard = PlainGuard()
    guard.observe(1.0, 1, plain=True)
    assert _steps(guard, 4000, 3.0, 2, first_spec=50.0).count("s") > 10  # it does probe
    kinds = _steps(PlainGuard(plain_rates={1: 1.0}), 4000, 3.0, 2, first_spec=50.0)
    assert _seconds_per_token(kinds, 3.0, 2, first_spec=50.0) <= 1 + 1.5 * PlainGuard().probe_share


@pytest.mark.parametrize("spec_seconds", [3.0, 10.0, 40.0])
def test_probes_that_lose_much_wait_long_enough_to_stay_near_plain(spec_seconds):
    """A speculative step far dearer than the tokens it brings (a draft as dear as the target): each lost probe is
    repaid by plain steps, so decoding stays within the probe share of plain's time, however dear the step; the
    doubling backoff alone (at most 64 plain steps a probe) would not bound it."""
    guard = PlainGuard(patience=2)  # no plain step measured: plain is estimated as a step without its drafting
    kinds = _steps(guard, 5000, spec_seconds, 2)
    assert _seconds_per_token(kinds, spec_seconds, 2) <= 1 + 1.5 * guard.probe_share  # a probe: 3 steps, 2 judged
    if spec_seconds >= 10:
        doubling_only = _steps(PlainGuard(patience=2, probe_share=1e9), 5000, spec_seconds, 2)
        assert _seconds_per_token(doubling_only, spec_seconds, 2) > 1.3


def test_a_guard_is_remembered_across_calls_by_target_and_key():
    from hf_specdec.plan.guard import remembered_guard

    target, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    draft, other_draft = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    guard = remembered_guard(target, draft, "key", PlainGuard)
    guard.plain_steps, guard.waiting = 3, 7
    again = remembered_guard(target, draft, "key", PlainGuard)
    assert again is guard and again.waiting == 7 and again.plain_steps == 0  # the wait goes on; counts per call
    assert remembered_guard(target, draft, "other key", PlainGuard) is not guard
    assert remembered_guard(other, draft, "key", PlainGuard) is not guard
    assert remembered_guard(target, other_draft, "key", PlainGuard) is not guard
    assert remembered_guard(target, None, "key", PlainGuard) is not guard


def test_the_next_call_goes_on_where_a_losing_call_left(monkeypatch):
    """A draft whose speculation loses: the first call judges it and turns plain; the next call with the same
    settings, which the guard's wait covers, decodes plainly with Transformers' loop (no draft pass at all), without
    judging again, and a call with other settings judges afresh."""
    monkeypatch.setattr(guarded, "PlainGuard", functools.partial(PlainGuard, margin=0.0, patience=2, backoff=1000))
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(5), 6)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    first = _generate(target, target, ids, RULED_CHAIN, new=24)
    second = _generate(target, target, ids, RULED_CHAIN, new=24)
    other = _generate(target, target, ids, ChainConfig(num_draft_tokens=3, confidence_threshold=0.4), new=24)
    for out in (first, second, other):
        assert torch.equal(out.sequences, plain)
    judged = first.speculation_stats
    assert judged.plain_steps > 0 and judged.target_forwards > judged.plain_steps  # speculated, then turned plain
    assert second.speculation_stats.call_price.startswith("the guard waits")
    assert second.speculation_stats.draft_forwards == 0 and second.speculation_stats.target_forwards == 24
    assert other.speculation_stats.target_forwards > other.speculation_stats.plain_steps  # judged afresh


def test_a_call_is_priced_with_the_drafts_pass_over_its_prompt():
    """Steps that win but cannot repay the draft's pass over the prompt: the call decodes plainly; steps that lose
    are left to the step guard; nothing measured: the call speculates (and measures)."""
    guard = PlainGuard()
    assert guard.price(48, 1000)[0]  # nothing measured yet
    guard.observe(0.4, 2, plain=True)  # a plain step: 0.2 s a token
    for _ in range(4):  # speculative steps: 0.1 s a token, 0.1 s of it in draft passes
        guard.observe(0.4, 4, plain=False, draft_seconds=0.1)
    guard.observe_prompt(0.1 + 2.0, 1000)  # a first step: its usual draft passes and 2 ms per prompt token
    assert guard.prompt_rate == pytest.approx(0.002)
    pays, why = guard.price(48, 100)  # 4.8 s + 0.2 s against 9.6 s plain
    assert pays and why.startswith("priced:") and why.endswith("speculates")
    pays, why = guard.price(48, 3000)  # 4.8 s + 6.0 s against 9.6 s plain
    assert not pays and why.endswith("decodes plainly") and "3000 prompt tokens" in why
    assert guard.price(400, 3000)[0]  # a longer answer repays the same prompt pass
    guard.spec_seconds = 4.0  # steps at 1 s a token: losing, whatever the prompt (the step guard's to judge)
    assert guard.price(48, 3000)[0]


def test_a_call_is_priced_at_earlier_calls_whole_rates_not_their_last_steps():
    """A call whose steps ran 0.1 s a token and whose last eight ran 0.16 (plain: 0.15): its steps' running means
    (what the step guard judges by) say the next call barely wins and cannot repay its prompt pass; the call's whole
    rate (0.129 s a token) says it wins by far, and prices the next call so. Before any call has ended the running
    means price it, as before."""
    guard = PlainGuard(margin=1.1, patience=100)  # nothing judged: this test prices only
    guard.observe(0.15, 1, plain=True)
    for seconds, tokens in [(0.3, 3)] * 6 + [(0.32, 2)] * 8:
        guard.observe(seconds, tokens, plain=False, draft_seconds=0.1)
    guard.observe_prompt(0.1 + 0.8, 100)  # the draft's pass over a 100-token prompt: 0.8 s
    step_rate = guard.spec_seconds / guard.spec_tokens
    assert 0.15 < step_rate < 0.165  # the last steps' running means: a win within the margin
    pays, why = guard.price(64, 200)  # 64 x 0.155 = 9.9 s + 1.6 s against 9.6 s plain x 1.1 = 10.56 s
    assert not pays and why.endswith("decodes plainly")
    guard.new_call()  # the call ended: its 35 tokens in 4.51 s join the calls' rate
    assert guard.past_rate == pytest.approx((0.15 + 6 * 0.3 + 8 * 0.32) / (1 + 18 + 16))
    pays, why = guard.price(64, 200)  # 64 x 0.129 = 8.25 s + 1.6 s against 9.6 s
    assert pays and "predicted 8.25 s speculating" in why
    guard.new_call()  # a call priced plain ran no step: the rate stands
    assert guard.past_rate == pytest.approx(4.51 / 35)


def test_a_prompt_pass_too_small_to_decide_leaves_the_call_to_speculate():
    """Steps predicted to win by less than the margin: a prompt pass of a tenth of the call's plain time or more
    prices the call plain; a smaller one is within the prediction's own error, and the call speculates."""
    guard = PlainGuard()
    guard.observe(0.2, 1, plain=True)  # plain: 0.2 s a token, 9.6 s for 48 tokens
    for _ in range(4):
        guard.observe(0.84, 4, plain=False, draft_seconds=0.1)  # 0.21 s a token: 10.08 s, a win within 1.1 x 9.6
    guard.observe_prompt(0.1 + 1.0, 1000)  # 1 ms per prompt token
    assert not guard.price(48, 1000)[0]  # 10.08 + 1.0 against 10.56, a pass of 10% of 9.6 s: plainly
    assert guard.price(48, 900)[0]  # 0.9 s, 9.4%: speculates (the step guard judges)


def test_a_call_the_guards_wait_covers_decodes_plainly_and_counts_as_waited():
    """A lost probe's wait asks for more plain steps than the next call may generate: that call decodes with
    Transformers' own loop (no draft pass over its prompt, no loop of ours), its tokens counted as waited; a call
    with fewer waited steps left than its tokens is priced as usual (its first steps plain in the loop); a wait that
    ends on a call's tokens leaves the next call to probe, judged on fresh measurements."""
    guard = PlainGuard()
    for _ in range(6):
        guard.observe(1.0, 1, plain=False, draft_seconds=0.5)  # losing steps, judged against nothing yet
    guard.waiting = 100
    pays, why = guard.price(48, 500)
    assert not pays and why.startswith("the guard waits 100 plain steps") and guard.waiting == 52
    assert not guard.price(48, 500)[0] and guard.waiting == 4
    pays, why = guard.price(48, 500)
    assert pays and why.startswith("not priced") and guard.waiting == 4  # the loop runs the last 4 plain
    guard.waiting = 48
    assert not guard.price(48, 500)[0] and guard.waiting == 0
    assert guard.spec_steps == 0 and guard.spec_seconds == 0.0  # the probe after the wait starts afresh


def test_calls_priced_plain_in_a_row_are_followed_by_one_that_measures_again():
    """A call priced plain measures nothing: the rates that priced it would price every later call the same way. After
    `refresh_calls` calls priced plain in a row the next speculates (and says why); a call that speculates on its
    price starts the count again."""
    guard = PlainGuard(refresh_calls=3)
    guard.observe(0.4, 2, plain=True)
    for _ in range(4):
        guard.observe(0.4, 4, plain=False, draft_seconds=0.1)
    guard.observe_prompt(0.1 + 2.0, 1000)
    verdicts = [guard.price(48, 3000) for _ in range(8)]  # 4.8 s + 6.0 s against 9.6 s plain: each priced plain
    assert [pays for pays, _ in verdicts] == [False, False, False, True, False, False, False, True]
    assert verdicts[3][1].endswith("speculates to measure again, after 3 calls priced plain")
    guard.price(48, 3000)
    assert guard.price(48, 100)[0] and guard.priced_plain == 0  # a short prompt pays: the count starts again
    assert [guard.price(48, 3000)[0] for _ in range(4)] == [False, False, False, True]


def test_a_call_priced_plain_decodes_as_plain_generate_and_says_why(monkeypatch):
    from hf_specdec.plan import guard as guard_module

    monkeypatch.setattr(guarded, "PlainGuard", PlainGuard)  # the suite's guard never judges: this one prices
    target = tiny_model("llama", 0)
    draft = copy.deepcopy(target)  # agrees with the target: every step accepts its chain
    ids = random_prompt(torch.Generator().manual_seed(7), 12)
    plain = target.generate(ids, do_sample=False, max_new_tokens=16)
    first = _generate(target, draft, ids, RULED_CHAIN, new=16).speculation_stats
    assert first.call_price.startswith("not priced") and first.target_forwards < 16
    (guard,) = guard_module._REMEMBERED[target]["by draft"][draft].values()
    assert guard.prompt_rate is not None  # the first call measured the draft's pass over its prompt
    guard.plain_rates, guard.waiting = {1: 1.0}, 0
    guard.spec_seconds, guard.spec_tokens, guard.spec_steps = 1.0, 2.0, 4  # steps win: 0.5 s a token against 1 s
    guard.prompt_rate = 10.0  # and the draft's pass over these 12 prompt tokens costs 120 s
    passes = []
    hook = draft.register_forward_pre_hook(lambda *args: passes.append(1))
    priced = _generate(target, draft, ids, RULED_CHAIN, new=16)
    hook.remove()
    assert torch.equal(priced.sequences, plain) and not passes  # the draft never ran
    stats = priced.speculation_stats
    assert stats.call_price.endswith("decodes plainly") and "decoded plainly" in stats.plan_source
    assert stats.as_dict()["call_price"] == stats.call_price  # what benchmarks record
    assert stats.target_forwards == 16 and stats.tokens_per_step == [1] * 16
    guard.prompt_rate = 1e-6
    again = _generate(target, draft, ids, RULED_CHAIN, new=16)
    assert torch.equal(again.sequences, plain) and again.speculation_stats.call_price.endswith("speculates")


def test_the_guard_leaves_winning_speculation_alone():
    guard = PlainGuard()
    for _ in range(20):
        assert not guard.plain_next()
        guard.observe(2.0, 5, plain=False, draft_seconds=1.0)  # 0.4 s a token against ~1 s without drafting
    assert guard.plain_steps == 0


# --- end to end on tiny models, with given latency curves ----------------------------------------------------
@pytest.fixture
def given_curves(monkeypatch):
    """Plans looked up get `curves`; sizers keep them uncorrected; the measured guard never fires."""
    state = {"curves": profile(100.0, 10.0)}

    def plan_for_call(request, target, draft, temperature, input_ids, ranks=None):
        tree = plan_tree(PRIOR, request.max_budget, request.max_depth)
        return SequoiaPlan(tree=tree, temperature=temperature, verifier="greedy", profile=state["curves"],
                           target={}, draft={}), "curves given by the test"

    def online_sizer(curves, target, draft, processors):
        return StepSizer(curves, OnlineAcceptance(), timing_memory=1.0)

    monkeypatch.setattr(integration, "plan_for_call", plan_for_call)
    monkeypatch.setattr(static_shape, "online_sizer", online_sizer)
    monkeypatch.setattr(guarded, "PlainGuard", functools.partial(PlainGuard, margin=float("inf")))
    return state


def _useless_draft(arch: str) -> torch.nn.Module:
    """A draft that always proposes the same token (the target rarely continues with it)."""
    draft = tiny_model(arch, 1)
    with torch.no_grad():
        draft.lm_head.weight.zero_()
        draft.lm_head.weight[7] = 1.0
    return draft


def _generate(target, draft, ids, config, new=40, **kwargs):
    return target.generate(ids, assistant_model=draft, speculation=config, max_new_tokens=new,
                           return_dict_in_generate=True, do_sample=False, **kwargs)


@pytest.mark.parametrize("method", ["sequoia", "tree", "chain"])
def test_a_perfect_draft_grows_deep_trees_and_output_stays_identical(given_curves, method):
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(3), 9)
    out = _generate(target, target, ids, method)
    stats = out.speculation_stats
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=40))
    assert stats.mean_tokens_per_step >= 3.5 and stats.plain_steps == 0


@pytest.mark.parametrize("method", ["sequoia", "tree", "chain"])
def test_the_same_draft_runs_plain_steps_when_costly_and_speculates_when_cheap(given_curves, method):
    """A perfect draft whose passes cost more than the target's never pays: plain steps (probes aside); the same
    draft at a tenth of the target's cost grows trees. The output is plain's either way."""
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(7), 9)
    plain = target.generate(ids, do_sample=False, max_new_tokens=40)
    given_curves["curves"] = profile(100.0, 150.0)
    costly = _generate(target, target, ids, method)
    given_curves["curves"] = profile(100.0, 10.0)
    cheap = _generate(target, target, ids, method)
    assert torch.equal(costly.sequences, plain) and torch.equal(cheap.sequences, plain)
    costly, cheap = costly.speculation_stats, cheap.speculation_stats
    assert costly.plain_steps >= 0.75 * costly.target_forwards and costly.mean_tokens_per_step < 1.5
    assert cheap.plain_steps == 0 and cheap.mean_tokens_per_step >= 3.5


@pytest.mark.parametrize("method", ["sequoia", "tree", "chain"])
def test_a_useless_draft_falls_to_plain_steps_and_output_stays_identical(given_curves, method):
    given_curves["curves"] = profile(100.0, 40.0)
    target, draft = tiny_model("llama", 0), _useless_draft("llama")
    ids = random_prompt(torch.Generator().manual_seed(4), 9)
    out = _generate(target, draft, ids, method, new=48)
    stats = out.speculation_stats
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=48))
    assert stats.plain_steps > stats.target_forwards // 2  # most steps plain, counted
    assert stats.drafted_tokens > 0  # probes still draft now and then
    assert stats.as_dict()["plain_steps"] == stats.plain_steps


def _sure_and_wrong_draft(arch: str) -> torch.nn.Module:
    """Another random model with its output layer scaled up: near one-hot probabilities, rarely the target's token."""
    draft = tiny_model(arch, 1)
    with torch.no_grad():
        draft.lm_head.weight.mul_(200.0)
    return draft


def test_a_sized_chain_stops_a_draft_sure_of_tokens_the_target_rejects(given_curves):
    """A draft that is sure (p near 1) and wrong: Transformers' rule (stop below 0.4) drafts on to the chain's end
    every step; the chain sized every step learns how rarely such tokens are kept and drafts short chains or plain
    steps. Plain's output either way; every sized step a chain (one node per level)."""
    given_curves["curves"] = profile(100.0, 40.0)
    target, draft = tiny_model("llama", 0), _sure_and_wrong_draft("llama")
    ids = random_prompt(torch.Generator().manual_seed(4), 9)
    plain = target.generate(ids, do_sample=False, max_new_tokens=48)
    shapes = []
    propose = SizedShapeDrafter.propose

    def seen(self, input_ids):
        tree = propose(self, input_ids)
        shapes.append(tree.host().parents)
        return tree

    ruled = _generate(target, draft, ids, ChainConfig(num_draft_tokens=8, confidence_threshold=0.4), new=48)
    SizedShapeDrafter.propose = seen
    try:
        sized = _generate(target, draft, ids, ChainConfig(num_draft_tokens=8), new=48)
    finally:
        SizedShapeDrafter.propose = propose
    assert torch.equal(ruled.sequences, plain) and torch.equal(sized.sequences, plain)
    assert shapes and all(parents == list(range(-1, len(parents) - 1)) for parents in shapes)  # chains only
    ruled, sized = ruled.speculation_stats, sized.speculation_stats
    assert "chain sized every step" in sized.plan_source and "sized" not in (ruled.plan_source or "")
    assert ruled.drafted_tokens >= 7 * ruled.target_forwards  # sure: the rule drafts (nearly) the whole chain
    assert sized.drafted_tokens <= 0.25 * ruled.drafted_tokens


def test_a_chain_sized_every_step_refuses_a_threshold_to_learn():
    with pytest.raises(ValueError, match="give a confidence_threshold to start from"):
        ChainConfig(adapt_threshold=True).validate()
    ChainConfig(adapt_threshold=True, confidence_threshold=0.4).validate()
    ChainConfig(adapt_threshold=True, per_step=False).validate()


def test_sampling_with_sized_trees_runs_sequoias_verifier(given_curves):
    target = tiny_model("qwen2", 0)
    ids = random_prompt(torch.Generator().manual_seed(5), 6)
    torch.manual_seed(0)
    out = target.generate(ids, assistant_model=target, speculation="sequoia", max_new_tokens=24, do_sample=True,
                          temperature=0.7, return_dict_in_generate=True)
    assert out.speculation_stats.verifier == "sequoia" and out.speculation_stats.new_tokens == 24
    assert out.speculation_stats.target_forwards < 24  # trees were drafted and accepted


@pytest.mark.parametrize("deepened", [False, True])
def test_sized_sequoia_samples_exactly(given_curves, deepened, request):
    """Sized every step, the tree's shape and depth follow the draft's own probabilities (the per-level stop, and,
    `deepened`, levels grown below a one-level shape under the likeliest node: the second token then comes from a
    grown level or a bonus); the first two sampled tokens still follow plain sampling's distribution (chi-square
    against the exact joint)."""
    if deepened:
        request.getfixturevalue("one_level_shapes")
    from tests.helpers.exactness import chi_square_pvalue, total_variation
    from tests.helpers.sampling import PROMPT, SAMPLES, SAMPLING, joint_of, sampling_pair

    target, draft = sampling_pair()
    exact = joint_of(target, PROMPT)
    torch.manual_seed(4321)
    counts, drafted, grown = {}, 0, 0
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, assistant_model=draft, speculation="sequoia", max_new_tokens=2,
                              return_dict_in_generate=True, **SAMPLING)
        key = tuple(out.sequences[0, PROMPT.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
        drafted += out.speculation_stats.drafted_tokens > 0 and out.speculation_stats.target_forwards == 1
        grown += out.speculation_stats.deepened_levels > 0
    assert chi_square_pvalue(counts, exact, SAMPLES) > 1e-3
    assert total_variation({k: c / SAMPLES for k, c in counts.items()}, exact) < 0.2
    assert drafted > SAMPLES // 10  # sized trees were drafted and accepted
    assert not deepened or grown > SAMPLES // 2  # levels were grown in most calls


@pytest.fixture
def one_level_shapes(monkeypatch):
    """The chooser always picks a menu shape one level deep (the root's children only), and the draft's tokens rate
    as `state["rate"]` (a sure draft by default) whatever their probability."""
    state = {"rate": 0.99}

    def choose(self, sizer, acceptance):
        return next(i for i, shape in enumerate(self.menu.shapes) if len(shape) > 2 and max(_depths(shape)) == 1)

    def log_rates(self, logq):
        return [math.log(state["rate"]) if math.isfinite(q) else q for q in logq]

    monkeypatch.setattr(ShapeChooser, "choose", choose)
    monkeypatch.setattr(OnlineAcceptance, "log_rates", log_rates)
    return state


def test_a_sure_draft_grows_levels_below_the_chosen_shape(given_curves, one_level_shapes):
    """Chosen one level deep, a draft whose tokens the target keeps 99% of the time drafts on below its likeliest
    node (steps emit more than the 2 tokens a one-level tree can); rated 5%, it stops at the chosen level. Greedy
    output is plain's either way."""
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(3), 9)
    plain = target.generate(ids, do_sample=False, max_new_tokens=40)
    sure = _generate(target, target, ids, "sequoia")
    one_level_shapes["rate"] = 0.05
    unsure = _generate(target, target, ids, "sequoia")
    assert torch.equal(sure.sequences, plain) and torch.equal(unsure.sequences, plain)
    sure, unsure = sure.speculation_stats, unsure.speculation_stats
    assert sure.deepened_levels > sure.target_forwards // 2 and max(sure.tokens_per_step) > 4
    assert sure.as_dict()["deepened_levels"] == sure.deepened_levels
    assert unsure.deepened_levels == 0 and max(unsure.tokens_per_step) <= 2


def test_shapes_and_plans_given_are_drafted_as_given(given_curves):
    target = tiny_model("llama", 0)
    given = plan_tree(PRIOR, 6, 3)
    drafters = {
        "tree widths": TreeConfig(widths=[2, 1]),
        "tree parents": TreeConfig(parents=[-1, 0, 0, 1]),
        "tree per_step=False": TreeConfig(per_step=False),
        "sequoia plan": SequoiaConfig(plan=given),
        "sequoia per_step=False": SequoiaConfig(per_step=False),
    }
    for name, config in drafters.items():
        request = config.plan_request()
        if request is not None:
            config = config.with_plan(*integration.plan_for_call(request, target, target, 0.0, None))
        drafter = config.make_drafter(target, target, None, "top_k", None)
        assert type(drafter) is ModelTreeDrafter, name
        assert drafter.host_shape.parents == config.shape(), name
    sized = TreeConfig()  # the default shape: sized every step
    sized = sized.with_plan(*integration.plan_for_call(sized.plan_request(), target, target, 0.0, None))
    assert isinstance(sized.make_drafter(target, target, None, "top_k", None), SizedShapeDrafter)
    ids = random_prompt(torch.Generator().manual_seed(6), 8)
    stats = _generate(target, target, ids, TreeConfig(widths=[2, 1])).speculation_stats
    assert stats.shrunk_steps == 0 and stats.drafted_tokens == 4 * (stats.target_forwards - stats.plain_steps)


def test_guard_false_keeps_every_step_speculative(monkeypatch):
    """A guard that always judges speculation the loser (margin 0) turns steps plain, unless `guard=False`."""
    monkeypatch.setattr(guarded, "PlainGuard", functools.partial(PlainGuard, margin=0.0, patience=1))
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(5), 9)
    plain = target.generate(ids, do_sample=False, max_new_tokens=32)
    guarded_out = _generate(target, target, ids, "chain", new=32)
    free = _generate(target, target, ids, ChainConfig(num_draft_tokens=4, confidence_threshold=0, guard=False),
                     new=32)
    assert torch.equal(guarded_out.sequences, plain) and torch.equal(free.sequences, plain)
    assert guarded_out.speculation_stats.plain_steps > 0
    assert free.speculation_stats.plain_steps == 0 and free.speculation_stats.mean_tokens_per_step >= 3.5
    with pytest.raises(ValueError, match="guard must be True or False, got 'no'"):
        _generate(target, target, ids, "chain", speculation_config={"guard": "no"})


@pytest.mark.parametrize("measured", [True, False])
def test_a_calls_first_step_is_judged_without_its_prompt_pass_once_drafting_was_measured(measured):
    """The first step's draft passes read the prompt: its share (the step's drafting beyond what a step's drafting
    costs, `drafted`) is the prompt's rate, and the rest is judged as a step, so a clear loss turns plain after the
    first two steps; before any step's drafting was measured the first step is not judged."""
    guard = PlainGuard(plain_rates={1: 1.0}, drafted=0.5 if measured else None)
    guard.observe_first(10.5, 1, 8.5, 100)  # 8 s of prompt pass over 100 tokens; the step itself 2.5 s for a token
    assert guard.prompt_rate == pytest.approx(0.08 if measured else 0.085)
    guard.observe(2.5, 1, False, 0.5)
    assert guard.plain_next() is measured  # 2.5 s a token against 1: a clear loss, after two judged steps
    assert guard.spec_steps == (2 if measured else 1)


def test_a_clear_loss_is_judged_sooner_than_a_slight_one():
    """Speculative steps costing `clear_loss` times plain's time per token or more are judged after `quick_patience`
    steps; a slighter loss (beyond the margin only) waits the whole `patience`."""
    clear = PlainGuard(probe_share=0.0)
    clear.observe(1.0, 1, plain=True)  # plain decoding: 1 s a token
    assert _steps(clear, 4, 3.0, 1).startswith("ss" + "p")  # 3 s for a token: turned plain after two steps
    slight = PlainGuard(probe_share=0.0)
    slight.observe(1.0, 1, plain=True)
    assert _steps(slight, 6, 2.6, 2).startswith("ssss" + "p")  # 1.3 s a token: after four


def _call(guard: PlainGuard, count: int, spec_seconds: float, spec_tokens: int, tree_pass: float = 1.0) -> str:
    """`_steps` as one call of `count` steps."""
    guard.new_call()
    return _steps(guard, count, spec_seconds, spec_tokens, tree_pass=tree_pass)


def test_a_sequences_guard_measures_plain_where_the_estimate_flatters_it(monkeypatch):
    """A tree pass dearer than a one-token pass (2 s against 1 s) makes the estimated plain rate 2 s a token: steps at
    1.5 s a token look like wins. The single sequence's guard measures one plain step after `patience` speculative
    ones, and then judges them the losers they are; later calls measure again only while the steps do not beat the
    measured rate `SURE_WIN` times over."""
    estimated = PlainGuard()
    assert _call(estimated, 12, 3.0, 2, tree_pass=2.0) == "s" * 12  # 1.5 s a token against an estimated 2 s
    monkeypatch.setattr(guarded, "sequence_guard", _real_sequence_guard)
    monkeypatch.setattr(guarded, "PlainGuard", PlainGuard)
    target = torch.nn.Linear(1, 1)
    guard = guarded.GuardedDrafter.guard_for(target, None, "losing")  # what generate prices and guards a call with
    kinds = _call(guard, 12, 3.0, 2, tree_pass=2.0)
    assert kinds.startswith("ssss" + "p") and kinds[5:].count("p") >= 4  # measured at 1 s a token: turned plain
    assert guard.plain_rates == {1: 1.0}
    sure = guarded.sequence_guard()
    assert _call(sure, 8, 1.8, 4).count("p") == 1  # 0.45 s a token: measured once, in the first call
    assert _call(sure, 8, 1.8, 4) == "s" * 8  # then beats 1 s by more than SURE_WIN: no plain step
    near = guarded.sequence_guard()
    assert [_call(near, 8, 1.8, 2).count("p") for _ in range(3)] == [1, 1, 1]  # 0.9 s a token: every call


@pytest.mark.parametrize("plain_now", [2.0, 1.0], ids=["machine-slowed", "same-speed"])
def test_a_loss_judged_against_another_calls_rate_is_confirmed_by_a_plain_step_first(monkeypatch, plain_now):
    """An earlier call measured plain decoding at 1 s a token; speculative steps now take 1.5 s a token, a clear
    loss against it. Before turning plain, the guard measures one plain step in this call: where the machine slowed
    down (2 s a plain token now) the steps win and go on; where it did not, the loss stands and the steps turn
    plain."""
    monkeypatch.setattr(guarded, "sequence_guard", _real_sequence_guard)
    monkeypatch.setattr(guarded, "PlainGuard", PlainGuard)  # the suite's guard never judges
    guard = guarded.sequence_guard()
    guard.observe(1.0, 1, plain=True)  # an earlier call's plain step
    guard.new_call()
    kinds = ""
    for _ in range(10):
        plain = guard.plain_next()
        guard.observe(plain_now if plain else 3.0, 1 if plain else 2, plain=plain, draft_seconds=0.0 if plain else 1.0)
        kinds += "p" if plain else "s"
    assert kinds.startswith("ssp")  # judged after two steps (a clear loss), confirmed by a plain step
    assert guard.call_rates[1] == pytest.approx(plain_now)  # judged by this call's plain rate from then on
    if plain_now == 2.0:
        assert kinds == "ssp" + "s" * 7
    else:
        assert kinds.startswith("sspsp")  # the loss stands: plain steps follow the next judgement


def test_a_sure_win_measures_plain_again_once_its_rate_is_refresh_calls_old(monkeypatch):
    """Steps beating the measured plain rate `SURE_WIN` times over skip the plain step, but not for ever: every
    `refresh_calls`-th call measures it again, so a rate that came out high (or a machine that sped up since) is not
    trusted for the rest of the process. A call that measured restarts the count."""
    monkeypatch.setattr(guarded, "sequence_guard", _real_sequence_guard)
    sure = guarded.sequence_guard()
    assert sure.refresh_calls == 3
    assert [_call(sure, 8, 1.8, 4).count("p") for _ in range(7)] == [1, 0, 0, 1, 0, 0, 1]
    high = guarded.sequence_guard()  # one plain step measured at 3 s a token: steps at 1.2 s look sure wins
    high.observe(3.0, 1, plain=True)
    kinds = [_call(high, 8, 2.4, 2) for _ in range(3)]
    assert kinds[:2] == ["s" * 8] * 2 and kinds[2].count("p") == 1  # measured again in the third call
    assert high.plain_rates[1] == pytest.approx(0.7 * 3.0 + 0.3 * 1.0)



def test_a_sequences_first_call_measures_one_plain_step_and_stays_identical(monkeypatch):
    """Through `generate`, with the single sequence's own guard (never judging a loss here): after its first four
    speculative steps one plain step measures plain decoding; the output is plain's."""
    monkeypatch.setattr(guarded, "sequence_guard", _real_sequence_guard)
    monkeypatch.setattr(guarded, "PlainGuard", functools.partial(PlainGuard, margin=float("inf")))
    target = tiny_model("llama", 0)
    draft = copy.deepcopy(target)  # every chain accepted: 3 tokens a step
    ids = random_prompt(torch.Generator().manual_seed(4), 7)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    out = _generate(target, draft, ids, ChainConfig(num_draft_tokens=2, confidence_threshold=0), new=24)
    assert torch.equal(out.sequences, plain)
    stats = out.speculation_stats
    assert stats.plain_steps == 1 and stats.tokens_per_step[5] == 1  # the step after the first four judged ones
