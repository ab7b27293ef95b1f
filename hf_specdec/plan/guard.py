"""The measured guard: speculation that keeps losing to plain decoding runs plain steps, and tries again later.

Every step's wall time (drafting, the target pass, verification, bookkeeping) and tokens are measured. A plain step
(the root alone) costs plain decoding's time per token exactly. Until one has run, the plain rate is estimated as a
speculative step without its draft passes (the target's pass over the tree, verification and bookkeeping: a pass
over one token costs no more on the hardware that speculation suits). That estimate flatters plain decoding where a
tree pass costs more than a one-token pass: on a 2-core Xeon with AMX, 48-token calls over a 760-token retrieved
context were judged against 0.22-0.38 s a token where plain calls took 0.21-0.23 with their prompt pass, and `chain`
lost them (0.68x) with not one step turned plain. So a guard measures one plain step once `patience` speculative
steps have run (`measure_plain`), and again in each later call whose steps do not beat the measured rate `sure_win`
times over (a single sequence's guard, `draft.guarded.sequence_guard`: 1.25x; a batch's: every call, below), and in
every call once `refresh_calls` calls have passed without one, whatever they beat: a rate measured once is a sample
of one step on a machine whose speed moves between calls (a 2-core Xeon decoded the same prompts plainly at 0.14 s a
token, then 0.18-0.24 minutes later), and a sample that came out high made every later step look a sure win, so it
was never measured again (one step at 0.26 s a token judged 14 calls of `sequoia`, plain running at 0.16-0.24). When
the running seconds per token of speculative steps exceed the plain rate by more than timing noise, the next
`backoff` steps run plain (judged after `patience` steps, or after `quick_patience` where they cost `clear_loss`
times plain's time per token: on the 760-token retrieved-context chat, a 48-token `chain` call ran 14 speculative
steps of its 32, judged four at a time, and lost to plain), once a plain step measured in the same call says so
(`call_rates`): a loss judged against an earlier call's rate (or the estimate) first measures one plain step and is
judged again against it. The machine's speed moves between calls: on a 2-core Xeon, four methods' calls over the
retrieved context ran 46 of their 48 steps plain, at 0.6 s a one-token target pass, judged against the rate earlier
calls had measured (plain's calls on the other prompts ran 0.15-0.24 s a token, prompt pass included), and lost to
plain 0.44-0.49x. Then speculation resumes as a probe (its rate measured
afresh), and `backoff` doubles each time the probe loses again and resets once it wins: acceptance that returns is
found within a bounded number of steps. A probe that lost much waits longer than `backoff`: enough plain steps (at
most `max_wait`) that what the probe lost is at most `probe_share` of their time, so where a speculative step costs
ten plain ones (a draft as dear as the target) the probes cannot make decoding much slower than plain. The probe's
first step feeds the draft every waited token: repaid, never judged.

A call goes on where the last call with the same target, draft, settings, processors and batch size left off
(`remembered_guard`): a pipeline over a dataset, or a benchmark's repeated calls, pays for judging speculation once, not
at every call's start. A single sequence's call is also priced before it drafts (`price`): the draft's first pass reads
the whole prompt (its window), which the steps must repay over the tokens the call may generate. From what earlier calls
measured (the draft's seconds per prompt token, their steps' seconds per token, the plain rate), a call whose steps win
but cannot repay that pass (a long retrieved context and a short answer: a pass of at least `PROMPT_SHARE` of the call's
plain time) decodes plainly from the start. So does a call while the guard still waits for at least as many plain steps
as the call may generate (a lost probe's wait reaching past its call): on a 2-core Xeon, after a probe slowed by another
process, the next two 48-token calls of `sequoia` ran every step plain through this loop, paying the draft's pass over
the prompt and the loop's bookkeeping, at 1.04x and 0.91x plain; Transformers' own loop runs them as plain generate
does, and they count as waited steps. Its steps are priced at earlier calls' whole rates (every step a call ran, the
plain ones the guard turned included, over its tokens; a running mean over calls), not at the running means the step
guard judges by, which follow a call's last few steps: on a 2-core Xeon they priced three sampled `chain` calls of code
at 0.161 s a token after calls that had run 0.098 and 0.108 s a token (plain 0.147), and all three decoded plainly. Over
574 priced calls of ten benchmark sets, earlier calls' whole rates were off the call's own by 1.27x at the median (1.71x
at the 90th percentile), the last steps' running means by 1.34x (2.10x). A call priced plain measures nothing, so the
rates that priced it would price every later call alike: after `refresh_calls` calls priced plain in a row, the next
speculates and measures again. On a 2-core Xeon one sampled `staged` call whose steps ran level with plain (the machine
slow in its minute) priced the next six plain, prompts of 56 tokens included, where `staged` had run 1.46x plain in an
earlier run of the same set.

A batch drafting for all its rows at once is guarded as a whole: a step's tokens are every row's, and a plain step
(every row's root alone) is plain batched decoding's step, which emits one token per row. There a target pass over
every row's tree costs far more than one over every row's root, so the estimate flatters plain decoding's rival:
`measure_plain` runs one plain step once `patience` speculative steps have run without one, to judge them by, and
again in every call that runs `patience` speculative steps over that many rows (once per call and row count), so
that the plain rate a call is judged by is a running mean over calls, not one step's timing (a plain step's time
moves 10-15% from minute to minute on a 2-core CPU, and 8-row calls that lost to Transformers' loop by up to 12%
were judged wins against one high sample). A call too short for that measures none: one plain step would cost it
much of what speculation saves.
Rows that finish leave the batch, and a plain batched step's cost per token grows as they do (2 rows: 0.2 s a token
on a 2-core Zen 3 against 0.085 s for 8), so plain rates are kept per row count and speculative steps are judged
against the rate of their own row count, their running means restarting when it changes (judged against 8 rows'
rate, the last 2 rows' winning steps looked like losses).

A batch's guard also judges whole calls (`observe_call`): steps that win can still lose the call, which pays the
draft's pass over every prompt and lasts as long as its slowest row (8 rows of 48 tokens on a 2-core Zen 3: every
step judged a win, the call 0.92x of plain batched decoding, the draft's prompt pass 3.35 s of a 3.4 s gap). A call
measured slower than plain batched decoding of the same tokens makes the next calls of this batch size decode with
Transformers' own loop from the start (`plain_call`: no draft prefill at all), `first_call_wait` of them, doubling
while the probe calls keep losing. It also keeps what the calls of its batch size measured of their rows' uneven
acceptance (`slowest_share`), which prices the next call (`call_pricing`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from .call_pricing import SLOWEST_ROW_SHARE, slowest_row_share

#: a call is priced plain only where the draft's pass over its prompt costs at least this share of plain decoding's
#: time for the call: a smaller pass decides nothing the prediction's own error does not (earlier calls' whole rates
#: are off a call's own by 1.27x at the median). On a 2-core Zen 4, `chain`'s steps predicted at 6.20 s for 48 tokens
#: against 5.71 s plain (a plain rate from one step, 0.119 s a token, where plain calls ran 0.15-0.18) priced three
#: chat calls plain for prompt passes of 0.17-0.49 s (3-9% of the call); its calls on the other prompts ran 1.4-1.9x.
#: Of 14 calls priced plain in 1,232 priced over this machine's and a Xeon's sets, 11 were decided by passes under a
#: tenth; the retrieved-context calls that the price is for took 10-17%.
PROMPT_SHARE = 0.1

#: the margin a batch's guard judges with: none. A single sequence keeps speculating within 10% of plain (timing noise
#: must not flip a step that wins); a batch, where speculation earns least and plain batched decoding is the rival,
#: turns plain as soon as its steps are measured slower than a plain batched step (a wrongly turned step costs only
#: what it would have won, until the next probe).
BATCH_MARGIN = 1.0


@dataclass
class PlainGuard:
    """Not synchronised: concurrent calls on one target with the same settings share a guard and mix their timings
    (what they decode is not affected, only how many steps run plain)."""

    patience: int = 4  # speculative steps measured before they are judged
    quick_patience: int = 2  # ... but a clear loss is judged after this many
    clear_loss: float = 1.5  # a clear loss: speculating costs this many times plain's time per token, or more
    margin: float = 1.1  # losing means slower than plain by this factor: timing noise alone must not flip a step
    backoff: int = 4  # plain steps after a loss; doubles after each lost probe
    max_backoff: int = 64
    probe_share: float = 0.1  # a lost probe's loss against plain, as a share of the plain steps that follow it
    max_wait: int = 1024  # the longest wait a lost probe's loss may ask for
    memory: float = 0.7  # weight of the past in the running means
    # rows -> seconds per token of a plain step over that many rows (running means; carried across calls)
    plain_rates: dict[int, float] = field(default_factory=dict)
    rows: int = 1  # the rows of the speculative steps the running means below are over
    spec_seconds: float = 0.0  # running means over speculative steps since the last (re)start
    spec_tokens: float = 0.0
    spec_steps: int = 0
    undrafted: float | None = None  # seconds of speculative steps outside draft passes (running mean)
    drafted: float | None = None  # seconds of a speculative step's draft passes (running mean)
    prompt_rate: float | None = None  # seconds per prompt token of the draft's pass over a call's prompt (running mean)
    past_rate: float | None = None  # seconds per token of earlier calls' steps, each call's whole (running mean)
    call_seconds: float = 0.0  # this call's steps so far (the first without the draft's prompt pass), for `past_rate`
    call_tokens: int = 0
    measure_plain: bool = False  # run one plain step to measure plain decoding, rather than estimate it
    #: once a plain rate is measured, a call whose speculative steps beat it this many times over measures no plain
    #: step of its own (inf: every call long enough to judge measures one)
    sure_win: float = math.inf
    #: ... but a rate measured this many calls ago is measured again, sure win or not (every call's: 1)
    refresh_calls: int = 3
    calls_since: dict[int, int] = field(default_factory=dict)  # rows -> calls begun since their plain rate's step
    priced_plain: int = 0  # calls priced plain in a row (`price`): after `refresh_calls` of them one speculates
    waiting: int = 0  # plain steps left before the next probe
    plain_steps: int = 0  # steps this guard turned plain in the current call (stats)
    probe_seconds: float = 0.0  # totals over speculative steps since the last judgement that did not lose
    probe_tokens: int = 0
    catching_up: bool = False  # the next speculative step follows a wait: its draft reads the waited tokens
    measured: set[int] = field(default_factory=set)  # row counts whose plain step this call has measured
    call_rates: dict[int, float] = field(default_factory=dict)  # rows -> this call's own plain rate (mean over it)
    confirming: bool = False  # a loss was judged against another call's rate: measure a plain step before acting
    call_spec_steps: int = 0  # speculative steps this call has run over `rows` rows
    first_call_wait: int = 2  # whole calls decoded plainly after a batch call lost; doubles after each lost probe
    max_call_wait: int = 32
    calls_waiting: int = 0  # calls left to decode plainly before the next speculative one
    last_call: tuple[float, float] | None = None  # the last judged call's (seconds, plain decoding's estimate)
    slowest_share: float = SLOWEST_ROW_SHARE  # the slowest row's tokens per step over the rows' mean (running mean)
    _call_wait: int = 0
    _base_backoff: int = 0

    def new_call(self) -> None:
        """A call begins: the judgement so far carries over (a wait under way goes on); the step counts restart, and
        the last call's steps join `past_rate`."""
        if self.call_tokens > 0:
            rate = self.call_seconds / self.call_tokens
            self.past_rate = rate if self.past_rate is None else self._mean(self.past_rate, rate)
        self.call_seconds, self.call_tokens = 0.0, 0
        self.plain_steps = 0
        self.measured, self.call_spec_steps, self.call_rates, self.confirming = set(), 0, {}, False
        self.calls_since = {rows: calls + 1 for rows, calls in self.calls_since.items()}

    def plain_next(self, rows: int = 1) -> bool:
        """Whether the next step, over `rows` rows, should be a plain one: asked once per step, as it is issued. A
        wait's plain steps are counted here, so steps never observed (a call's last) still shorten it."""
        if self.waiting > 0:
            self.waiting -= 1
            self.plain_steps += 1
            if self.waiting == 0:  # probe: speculate again, judged on fresh measurements
                self._start_probe()
                self.catching_up = True
            return True
        if self.confirming:  # a loss judged against a rate this call has not measured: measure it now
            self.confirming = False
            self.plain_steps += 1
            return True
        if not (self.measure_plain and rows == self.rows and self.spec_steps >= self.patience):
            return False
        if rows not in self.plain_rates:
            return True
        rate = self.spec_seconds / max(self.spec_tokens, 1e-9)
        unsure = math.isinf(self.sure_win) or rate * self.sure_win > self.plain_rates[rows]
        stale = self.calls_since.get(rows, 0) >= self.refresh_calls
        return rows not in self.measured and self.call_spec_steps >= self.patience and (unsure or stale)

    def reference(self) -> float | None:
        """Seconds per token of plain decoding over the judged steps' rows: measured in this call, else in earlier
        calls, else estimated from the target's passes."""
        return self.call_rates.get(self.rows, self.plain_rates.get(self.rows, self.undrafted))

    def observe(self, seconds: float, tokens: int, plain: bool, draft_seconds: float = 0.0, rows: int = 1) -> None:
        """A step took `seconds` (`draft_seconds` of them in draft passes) and emitted `tokens`; `plain`: it verified
        the root alone (every row's, for a batch of `rows` rows)."""
        self.call_seconds += seconds
        self.call_tokens += tokens
        if plain:
            self.measured.add(rows)
            self.calls_since[rows] = 0
            rate = seconds / max(tokens, 1)
            self.plain_rates[rows] = self._mean(self.plain_rates[rows], rate) if rows in self.plain_rates else rate
            known = self.call_rates.get(rows)
            self.call_rates[rows] = rate if known is None else self._mean(known, rate)
            return
        if rows != self.rows:  # rows finished (or a new call's batch): judged afresh against their own plain rate
            self.rows, self.spec_steps, self.call_spec_steps = rows, 0, 0
        self.call_spec_steps += 1
        self.probe_seconds += seconds  # what a lost probe repays: every speculative step's cost
        self.probe_tokens += tokens
        if self.catching_up:  # its draft pass read every token of the wait: a cost of probing, not a measure of
            self.catching_up = False  # how speculation fares (judged by it, a long wait would make the next longer)
            return
        first = self.spec_steps == 0
        self.spec_seconds = seconds if first else self._mean(self.spec_seconds, seconds)
        self.spec_tokens = tokens if first else self._mean(self.spec_tokens, tokens)
        self.spec_steps += 1
        undrafted = max(seconds - draft_seconds, 0.0) / rows  # per token of a plain step: one per row
        self.undrafted = undrafted if self.undrafted is None else self._mean(self.undrafted, undrafted)
        self.drafted = draft_seconds if self.drafted is None else self._mean(self.drafted, draft_seconds)
        reference = self.reference()
        if reference is None or self.spec_steps < min(self.patience, self.quick_patience):
            return
        rate = self.spec_seconds / max(self.spec_tokens, 1e-9)
        if self.spec_steps < self.patience and rate < self.clear_loss * reference:
            return  # this early only a clear loss is judged: a 48-token call cannot afford patience on one
        if rate >= self.margin * reference:
            if self.measure_plain and rows not in self.call_rates:  # judged against another call's rate (or an
                self.confirming = True  # estimate): the machine's speed moves between calls; measure plain first
                return
            self._base_backoff = self._base_backoff or self.backoff
            self.waiting = max(self._base_backoff, self._repaying_wait(reference, rows))
            self._base_backoff = min(2 * self._base_backoff, self.max_backoff)
        else:  # not losing: what a later loss repays is counted from here
            self.probe_seconds, self.probe_tokens = 0.0, 0
            if self.spec_steps == self.patience:
                self._base_backoff = 0  # the probe won: the next loss backs off briefly again

    def observe_prompt(self, draft_seconds: float, tokens: int) -> None:
        """A call's first step (a speculative one) spent `draft_seconds` in draft passes, the draft reading `tokens`
        prompt tokens in the first: what a speculative step's draft passes cost (`drafted`) is its tree's, the rest
        the prompt's."""
        if tokens <= 0:
            return
        rate = max(draft_seconds - (self.drafted or 0.0), 0.0) / tokens
        self.prompt_rate = rate if self.prompt_rate is None else self._mean(self.prompt_rate, rate)

    def observe_first(self, seconds: float, tokens: int, draft_seconds: float, prompt_tokens: int) -> None:
        """A call's first step, a speculative one, took `seconds` and emitted `tokens`, `draft_seconds` of it in draft
        passes that read `prompt_tokens` prompt tokens first: the prompt's share is learnt (`observe_prompt`), and
        once earlier calls measured what a step's draft passes cost (`drafted`), the rest is judged as a step that
        drafted that much: a call whose steps lose turns plain a step sooner (48-token calls run 15-30 steps)."""
        drafted = self.drafted
        self.observe_prompt(draft_seconds, prompt_tokens)
        if drafted is None or prompt_tokens <= 0:
            return
        prompt = max(draft_seconds - drafted, 0.0)
        self.observe(seconds - prompt, tokens, False, draft_seconds - prompt)

    def price(self, new_tokens: int, prompt_tokens: int) -> tuple[bool, str]:
        """(whether this call speculates, why), before it drafts: `new_tokens` the most it may generate, the draft
        reading `prompt_tokens` of its prompt first. From the rates earlier calls with these settings measured (their
        whole steps' seconds per token, `past_rate`; before a call has ended, the running means of its steps): a
        call speculates unless its steps are predicted to win (within `margin`, as a step is judged) but not by
        enough to repay the draft's pass over the prompt. Steps predicted to lose are left to the step guard (a
        prompt of another kind may draft better); a call with nothing measured yet speculates, and measures."""
        if new_tokens > 0 and self.waiting >= new_tokens:  # every step would be plain: Transformers' own loop runs
            self.waiting -= new_tokens  # them cheaper (no draft prompt pass, no loop of ours); they count as waited
            if self.waiting == 0:
                self._start_probe()  # the next call probes (its first step reads its prompt: judged as a first)
            return False, (f"the guard waits {self.waiting + new_tokens} plain steps after speculation lost, at least "
                           f"the call's {new_tokens} tokens: decodes plainly")
        reference = self.reference()
        if reference is None or self.prompt_rate is None or self.spec_steps == 0 or new_tokens <= 0:
            return True, "not priced (no earlier call with these settings measured the draft's prompt pass)"
        rate = self.past_rate if self.past_rate is not None else self.spec_seconds / max(self.spec_tokens, 1e-9)
        steps = new_tokens * rate
        prompt, plain = self.prompt_rate * prompt_tokens, new_tokens * reference
        pays = not (steps < self.margin * plain <= steps + prompt and prompt >= PROMPT_SHARE * plain)
        verdict = "speculates" if pays else "decodes plainly"
        if not pays and self.priced_plain >= self.refresh_calls:  # the rates are as old as the last call that drafted
            pays, verdict = True, f"speculates to measure again, after {self.priced_plain} calls priced plain"
        self.priced_plain = 0 if pays else self.priced_plain + 1
        return pays, (f"priced: {new_tokens} tokens predicted {steps:.2f} s speculating, plus {prompt:.2f} s for the "
                      f"draft's pass over {prompt_tokens} prompt tokens, against {plain:.2f} s plain: {verdict}")

    def plain_call(self) -> bool:
        """Whether this batch call should decode plainly from the start (a recent call lost); asked once per call."""
        if self.calls_waiting > 0:
            self.calls_waiting -= 1
            return True
        return False

    def observe_call(self, seconds: float, row_tokens: list[int], row_rates: Sequence[float] = ()) -> None:
        """A speculative call over `len(row_tokens)` rows gave them `row_tokens` new tokens in `seconds` after the
        target's prompt pass (the draft's included). Transformers' plain loop gives the same tokens (greedy) by
        one step over every row per token after the first (the prompt pass gives it; finished rows are decoded on
        until the last row ends), at the rate measured for plain steps over that many rows; unjudged until one is.
        `row_rates`: each row's tokens per speculative step, for `slowest_share`."""
        share = slowest_row_share(row_rates)
        if share is not None:
            self.slowest_share = self._mean(self.slowest_share, share)
        rows = len(row_tokens)
        if rows not in self.plain_rates:
            return
        plain = (max(row_tokens) - 1) * rows * self.plain_rates[rows]
        self.last_call = (seconds, plain)
        if seconds > self.margin * plain:
            self._call_wait = min(2 * self._call_wait, self.max_call_wait) if self._call_wait else self.first_call_wait
            self.calls_waiting = self._call_wait
        else:
            self._call_wait = 0

    def _start_probe(self) -> None:
        """A wait is over: speculation runs again, judged on fresh measurements."""
        self.spec_seconds = self.spec_tokens = self.probe_seconds = 0.0
        self.spec_steps = self.probe_tokens = 0

    def _repaying_wait(self, reference: float, rows: int) -> int:
        """Plain steps (one token per row each) over which the speculative steps since the last judgement that did
        not lose cost at most `probe_share` more than plain decoding would have; at most `max_wait`."""
        lost = self.probe_seconds - reference * self.probe_tokens  # seconds plain decoding would have saved
        plain_step = reference * rows
        if not (lost > 0 and plain_step > 0 and self.probe_share > 0):
            return 0
        steps = lost / (self.probe_share * plain_step)
        return min(math.ceil(steps), self.max_wait) if math.isfinite(steps) else self.max_wait

    def _mean(self, old: float, new: float) -> float:
        return self.memory * old + (1 - self.memory) * new


#: target model -> draft model (weakly; None for methods without one) -> key -> guard
_REMEMBERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_REMEMBERED = 32  # guards kept per target and draft: the oldest settings are forgotten first


def remembered_guard(target: object, draft: object | None, key: Hashable, make: Callable[[], PlainGuard]
                     ) -> PlainGuard:
    """The guard of this call: the one the last call with `target`, `draft` and `key` (the settings, processors
    and batch size) left, else `make()`; kept while both models live."""
    drafts = _REMEMBERED.setdefault(target, {None: {}, "by draft": weakref.WeakKeyDictionary()})
    guards = drafts[None] if draft is None else drafts["by draft"].setdefault(draft, {})
    guard = guards.get(key)
    if guard is None:
        if len(guards) >= MAX_REMEMBERED:
            del guards[next(iter(guards))]
        guard = guards[key] = make()
    guard.new_call()
    return guard
