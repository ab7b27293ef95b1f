"""A batch never slower than plain batched generate (issue 25): the call is priced whole (the draft's prefill
over every prompt must be repaid by what the steps save over the call's tokens, else Transformers' own loop decodes
it), the draft's root pass computes its output layer at the roots only, the guard is not charged with the draft's
prefill, and a batch's guard allows no loss."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_specdec.plan.call_pricing import SLOWEST_ROW_SHARE, call_pays, saving_per_token, slowest_row_share
from hf_specdec.plan.guard import BATCH_MARGIN, PlainGuard
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.sizing import HardwareProfile
from tests.helpers.batches import (
    NEW,
    flat_until,
    hooked_chain_call,
    near_draft,
    padded_batch,
    sized_batch,
    sized_batch_drafters,
)
from tests.tiny import tiny_model


def test_call_pays_only_when_the_saving_over_the_call_repays_the_setup():
    per_token = np.array([0.025, 0.030, 0.020, 0.022])  # plain, then three shapes: the second saves 5 ms a token
    assert saving_per_token(per_token) == (2, pytest.approx(0.005))
    assert call_pays(per_token, 100, 0.4, margin=0.0)  # 0.5 s saved
    assert not call_pays(per_token, 60, 0.4, margin=0.0)  # 0.3 s saved: the setup is not repaid
    assert not call_pays(np.array([0.02, 0.03]), 10_000, 0.0)  # nothing beats plain, whatever the length
    assert saving_per_token(np.array([0.02, 0.03])) == (0, 0.0)


def test_a_call_must_be_predicted_to_save_the_margin_of_plain_decoding():
    """Plain decoding 25 ms a token; the best shape saves 5 ms (20%). Over 100 tokens (2.5 s plain) a setup of
    0.1 s leaves 0.4 s (16%): above the default 10% margin; a setup of 0.3 s leaves 0.2 s (8%): a near-tie,
    decoded plainly."""
    per_token = np.array([0.025, 0.030, 0.020, 0.022])
    assert call_pays(per_token, 100, 0.1)
    assert call_pays(per_token, 100, 0.3, margin=0.0)  # repaid, but by less than the prediction's error
    assert not call_pays(per_token, 100, 0.3)
    assert not call_pays(per_token, 10**6, 0.0, margin=0.25)  # never: the steps save 20% of plain at most


def test_a_call_too_short_to_repay_the_drafts_prefill_decodes_plainly(monkeypatch):
    """A draft whose pass costs grow with every token (4 ms each) and a target flat up to 16 tokens: each step saves
    about 13 ms a token, and the draft's prefill over 2 rows of 9 prompt tokens costs 72 ms. Two new tokens a row
    cannot repay it (Transformers' loop decodes the batch); twenty can (the batch speculates). Both outputs are plain
    batched generate's."""
    target = tiny_model("llama", 0)
    draft = near_draft(target, noise=0.05)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    draft_curve = LatencyCurve(sizes, tuple(0.004 * size for size in sizes))
    drafters = sized_batch(monkeypatch, HardwareProfile(flat_until(16, 0.050), draft_curve), [0.9])
    ids, mask = padded_batch(11, [0, 3])
    for new, speculates in ((2, False), (NEW, True)):
        call = dict(attention_mask=mask, max_new_tokens=new, do_sample=False)
        out = target.generate(ids, **call, assistant_model=draft, speculation="chain", return_dict_in_generate=True)
        assert torch.equal(out.sequences, target.generate(ids, **call))
        stats = out.speculation_stats
        assert isinstance(stats, list) == speculates  # one entry per row where the batch loop ran
        assert speculates or "decoded plainly" in stats.plan_source
    assert len(drafters) == 1  # only the long call drafted


def test_the_slowest_row_share_is_the_least_rate_over_the_mean():
    """Rows at 4, 2, 4 and 2 tokens a step: the slowest adds 2/3 of the mean. A row that never speculated (0) is not
    counted, and one row measures no spread."""
    assert slowest_row_share([4.0, 2.0, 4.0, 2.0]) == pytest.approx(2 / 3)
    assert slowest_row_share([0.0, 3.0, 1.0]) == pytest.approx(0.5)
    assert slowest_row_share([3.0]) is None and slowest_row_share([0.0, 3.0]) is None and slowest_row_share([]) is None


def test_a_batch_guard_learns_its_rows_spread_from_every_call():
    """A fresh guard prices with the measured prior; each call's rows move it (a running mean, like its rates), also
    where plain steps over that many rows were never measured (the call itself is then not judged)."""
    guard = PlainGuard(margin=BATCH_MARGIN)
    assert guard.slowest_share == SLOWEST_ROW_SHARE
    guard.observe_call(4.0, [10, 8, 10, 6], [4.0, 2.0, 4.0, 2.0])
    expected = guard.memory * SLOWEST_ROW_SHARE + (1 - guard.memory) * 2 / 3
    assert guard.slowest_share == pytest.approx(expected) and guard.last_call is None
    guard.observe_call(4.0, [10, 8], [3.0])  # one row that speculated: no spread measured
    assert guard.slowest_share == pytest.approx(expected)


def test_a_shape_is_priced_by_what_its_slowest_row_adds():
    """Priced at a share of the expected tokens, every drafting shape costs 1/share more per token, down to one token
    a step (its bonus token); the root alone (plain) costs the same."""
    from hf_specdec.plan.shape_sizing import RankAcceptance, ShapeMenu
    from hf_specdec.plan.step_sizing import StepSizer

    menu = ShapeMenu.of([[-1, 0], [-1, 0, 1, 2]])
    sizer = StepSizer(HardwareProfile(flat_until(16, 0.05), flat_until(16, 0.01)))
    rows = [RankAcceptance([0.9], menu.width)] * 4
    mean, slowest = menu.seconds_per_token(sizer, rows), menu.seconds_per_token(sizer, rows, 0.7)
    expected = menu.expected_tokens(rows[0].vectors())
    assert slowest[0] == pytest.approx(mean[0])
    assert slowest[1:] == pytest.approx(mean[1:] * expected[1:] / np.maximum(0.7 * expected[1:], 1.0))
    assert expected[1] == pytest.approx(1.9)  # at 0.5 that is 0.95 tokens: one, the bonus token
    assert menu.seconds_per_token(sizer, rows, 0.5)[1] == pytest.approx(mean[1] * expected[1])


@pytest.mark.parametrize("share, speculates", [(1.0, True), (SLOWEST_ROW_SHARE, True), (0.3, False)])
def test_a_batch_priced_by_its_slowest_row_decodes_plainly_when_that_row_cannot_repay_the_call(
        monkeypatch, share, speculates):
    """The call of `test_a_call_too_short_to_repay_the_drafts_prefill_decodes_plainly` that speculates (20 new
    tokens a row) priced with its slowest row adding `share` of its predicted tokens: at the measured prior it still
    repays the draft's prefill, at 0.3 it does not and Transformers' loop decodes it. Both outputs are plain batched
    generate's."""
    from hf_specdec.integration import batch as batch_module

    target = tiny_model("llama", 0)
    draft = near_draft(target, noise=0.05)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    drafters = sized_batch(monkeypatch, HardwareProfile(flat_until(16, 0.050),
                                                        LatencyCurve(sizes, tuple(0.004 * s for s in sizes))), [0.9])
    monkeypatch.setattr(batch_module, "SLOWEST_ROW_SHARE", share)  # the guard is off here: the prior prices
    ids, mask = padded_batch(11, [0, 3])
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    out = target.generate(ids, **call, assistant_model=draft, speculation="chain", return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, **call))
    assert isinstance(out.speculation_stats, list) == speculates == bool(drafters)
    assert speculates or "no tree is predicted to repay" in out.speculation_stats.plan_source


def test_rows_drafting_one_after_another_sum_their_draft_passes():
    """A pass over n nodes per row, for rows drafting their own trees: the target's is one pass over rows * n tokens
    (as for rows drafting in lockstep), the draft's `rows` passes over n tokens (lockstep: one over rows * n)."""
    from hf_specdec.plan.sizing import for_batch, row_by_row

    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    profile = HardwareProfile(flat_until(16, 0.05), LatencyCurve(sizes, tuple(0.01 + 0.001 * s for s in sizes)))
    for rows in (1, 2, 4):
        lockstep, one_by_one = for_batch(profile, rows), row_by_row(profile, rows)
        assert one_by_one.target == lockstep.target
        for n in (1, 4, 16):
            assert one_by_one.target(n) == pytest.approx(profile.target(rows * n))
            assert one_by_one.draft(n) == pytest.approx(rows * profile.draft(n))
            assert lockstep.draft(n) == pytest.approx(profile.draft(rows * n))
    assert row_by_row(profile, 4).draft(4) > for_batch(profile, 4).draft(4)  # 4 x 14 ms against 26 ms


@pytest.mark.parametrize("method", ["specexec", "staged"])
def test_a_batch_of_best_first_trees_is_priced_before_its_call(monkeypatch, method):
    """`staged` drafts every row's tree in its own passes, one row after another; `specexec` grows every row's tree
    in lockstep. A target pass of 50 ms (flat up to 16 tokens) and a draft pass of 10 ms: 4 rows drafting a chain or
    best-first trees in lockstep share each draft pass, and the trees are predicted to repay the call; 4 rows
    drafting one after another pay 40 ms a level, no tree is, and Transformers' loop decodes the call. With a 1 ms
    draft pass `staged` speculates too. Every output is plain batched generate's."""
    from hf_specdec.integration import batch as batch_module
    from hf_specdec.integration import generate as integration
    from hf_specdec.methods.sequoia.sizing import sequoia_menu

    target = tiny_model("llama", 0)
    draft = near_draft(target, noise=0.05)
    ids, mask = padded_batch(11, [0, 3, 2, 1])
    monkeypatch.setattr(batch_module, "sequoia_menu", sequoia_menu)  # the DP's trees for the plan's own vector
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(ids, **call).sequences
    drafters = sized_batch(monkeypatch, HardwareProfile(flat_until(16, 0.05), flat_until(16, 0.01)), [0.9])
    out = target.generate(ids, **call, assistant_model=draft, speculation="chain")
    assert torch.equal(out.sequences, plain) and isinstance(out.speculation_stats, list) and drafters
    out = target.generate(ids, **call, assistant_model=draft, speculation=method)
    assert torch.equal(out.sequences, plain)
    if method == "specexec":  # in lockstep: priced as the chain is
        assert isinstance(out.speculation_stats, list)
        assert max(max(row.tokens_per_step) for row in out.speculation_stats) > 1
        return
    assert "no tree is predicted to repay" in out.speculation_stats.plan_source
    cheap = SimpleNamespace(profile=HardwareProfile(flat_until(16, 0.05), flat_until(16, 0.001)), acceptance=[0.9])
    monkeypatch.setattr(integration, "plan_for_call", lambda *args, **kwargs: (cheap, "curves given here"))
    out = target.generate(ids, **call, assistant_model=draft, speculation=method)
    assert torch.equal(out.sequences, plain)
    assert isinstance(out.speculation_stats, list)
    assert max(max(row.tokens_per_step) for row in out.speculation_stats) > 1  # drafted tokens were accepted


def test_a_batch_call_hands_its_guard_each_rows_tokens_per_speculative_step(monkeypatch):
    """What the guard learns the spread from: per row, new tokens over target steps, plain steps (one token each)
    taken off both."""
    from hf_specdec.integration import batch as batch_module

    calls = []

    class Recording(PlainGuard):
        def observe_call(self, seconds, row_tokens, row_rates=()):
            calls.append((row_tokens, list(row_rates)))
            super().observe_call(seconds, row_tokens, row_rates)

    monkeypatch.setattr(batch_module, "PlainGuard", Recording)
    target = tiny_model("qwen2", 0)
    ids, mask = padded_batch(16, [0, 2, 4])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          assistant_model=near_draft(target), speculation="chain", return_dict_in_generate=True)
    assert len(calls) == 1
    tokens, rates = calls[0]
    assert tokens == [row.new_tokens for row in out.speculation_stats]
    assert rates == [pytest.approx((row.new_tokens - row.plain_steps) / (row.target_forwards - row.plain_steps))
                     for row in out.speculation_stats]
    assert all(rate >= 1.0 for rate in rates)


def test_the_root_pass_computes_the_output_layer_at_the_roots_only():
    """The lockstep draft's first pass feeds every row its whole prompt, and each later root pass every row what it
    emitted, but only each row's root needs logits: no pass that feeds committed tokens returns more than one
    column per row (its output layer ran over those alone), and the output is plain batched generate's."""
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(12, [0, 2, 5])
    passes = []
    hook = draft.register_forward_hook(
        lambda module, args, kwargs, out: passes.append((kwargs["input_ids"].shape[1], out.logits.shape[1])),
        with_kwargs=True)
    hooked_chain_call(target, draft, ids, mask, hook)
    roots = passes[::3]  # the chain's passes: the root pass, then one per level of one node
    assert roots[0][0] == ids.shape[1] and all(fed == 1 for fed, _ in passes[1::3])
    assert all(columns <= min(fed, ids.shape[0]) for fed, columns in roots)
    assert roots[0][1] < roots[0][0]


def test_the_batch_guard_is_not_charged_with_the_drafts_prefill(monkeypatch):
    """The draft's first pass reads every prompt, once per call: a prefill made slow (1 s) must not count as the
    first step's cost (it would make a winning speculation look like a loss and turn the batch plain)."""
    from hf_specdec.integration import batch as batch_module

    observed, guards = [], []

    class Recording(PlainGuard):
        def observe(self, seconds, tokens, plain, draft_seconds=0.0, rows=1):
            observed.append((seconds, draft_seconds))
            super().observe(seconds, tokens, plain, draft_seconds, rows)

    monkeypatch.setattr(batch_module, "PlainGuard", lambda **kwargs: guards.append(Recording(**kwargs)) or guards[-1])
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(13, [0, 2, 4])

    def slow_prefill(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == ids.shape[1]:  # the pass that feeds the prompts
            time.sleep(1.0)  # far above a tiny model's step, even on a loaded machine

    hook = draft.register_forward_pre_hook(slow_prefill, with_kwargs=True)
    drafters = sized_batch_drafters(monkeypatch)
    try:
        target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                        speculation="chain", return_dict_in_generate=True)
    finally:
        hook.remove()
    assert guards and observed
    assert drafters[0].prefill_seconds >= 1.0
    assert all(seconds < 1.0 and draft_seconds < 1.0 for seconds, draft_seconds in observed)


def test_a_batch_guard_turns_plain_on_any_measured_loss():
    """A single sequence's guard tolerates steps 5% slower than plain (timing noise); a batch's does not: plain
    batched steps at 0.25 s a token, speculative ones at 0.2625."""
    for margin, turns in ((PlainGuard().margin, False), (BATCH_MARGIN, True)):
        guard = PlainGuard(patience=2, measure_plain=True, margin=margin)
        guard.observe(1.0, 4, plain=True, rows=4)
        for _ in range(2):
            guard.observe(2.1, 8, plain=False, rows=4)
        assert guard.plain_next() == turns


def test_a_batch_is_guarded_without_a_margin(monkeypatch):
    """The batch's guard judges with `BATCH_MARGIN` (the suite's fixture lifts it: undone here) and measures a plain
    step before judging by one."""
    from hf_specdec.integration import batch as batch_module

    monkeypatch.setattr(batch_module, "BATCH_MARGIN", BATCH_MARGIN)
    made = []
    monkeypatch.setattr(batch_module, "PlainGuard", lambda **kwargs: made.append(PlainGuard(**kwargs)) or made[-1])
    target = tiny_model("llama", 0)
    ids, mask = padded_batch(14, [0, 1])
    target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, assistant_model=near_draft(target),
                    speculation="chain")
    assert made and all(guard.margin == BATCH_MARGIN and guard.measure_plain for guard in made)


def test_a_batch_call_measured_slower_than_plain_makes_the_next_calls_plain():
    """Plain steps over 4 rows at 0.1 s a token: a call giving them 10, 8, 10 and 6 tokens is plain batched
    decoding's 9 steps over all 4 rows (the prompt pass gives the first token; finished rows are decoded on), 3.6 s.
    A call of 4 s loses: the next 2 calls decode plainly, then one probes; a probe that loses waits 4 calls, one that
    wins resets the wait. Calls over rows whose plain steps were never measured are not judged."""
    guard = PlainGuard(margin=BATCH_MARGIN, plain_rates={4: 0.1})
    guard.observe_call(4.0, [10, 8, 10, 6])
    assert guard.last_call == (4.0, pytest.approx(3.6))
    assert [guard.plain_call() for _ in range(3)] == [True, True, False]
    guard.observe_call(3.7, [10, 8, 10, 6])  # the probe loses again
    assert [guard.plain_call() for _ in range(5)] == [True] * 4 + [False]
    guard.observe_call(3.5, [10, 8, 10, 6])  # a probe that wins
    assert not guard.plain_call()
    guard.observe_call(4.0, [10, 8, 10, 6])
    assert [guard.plain_call() for _ in range(3)] == [True, True, False]
    guard.observe_call(100.0, [10, 8, 10])  # 3 rows: plain steps over 3 were never measured
    assert not guard.plain_call() and guard.last_call == (4.0, pytest.approx(3.6))


@pytest.mark.parametrize("plain_rate, plain_calls", [(1e-9, 2), (1e3, 0)])
def test_a_batch_decodes_plainly_after_a_call_that_lost_to_plain(monkeypatch, plain_rate, plain_calls):
    """The batch's guard as if plain steps over 2 rows had been measured at `plain_rate` s a token (its steps never
    judged, so no plain step runs and the rate stays): at 1 ns every speculative call loses, and the 2 calls after
    it decode with Transformers' own loop (saying why), then one speculates again; at 1000 s none loses and every
    call speculates. Every output is plain batched generate's."""
    from hf_specdec.integration import batch as batch_module

    monkeypatch.setattr(batch_module, "PlainGuard", lambda **kwargs: PlainGuard(
        **{**kwargs, "margin": BATCH_MARGIN, "plain_rates": {2: plain_rate}, "patience": 10**9}))
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(15, [0, 3])
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    plain = target.generate(ids, **call)
    speculated = []
    for _ in range(4):
        out = target.generate(ids, **call, assistant_model=draft, speculation="chain", return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        stats = out.speculation_stats
        speculated.append(isinstance(stats, list))  # one entry per row where the batch loop ran
        assert speculated[-1] or "a recent call of 2 rows" in stats.plan_source and "decoded plainly" in \
            stats.plan_source
    assert speculated == [True] + [False] * plain_calls + [True] * (3 - plain_calls)
