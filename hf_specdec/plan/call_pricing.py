"""Whether speculation pays for a whole batch call, not only step by step.

Before its first tree the draft must read every row's prompt: one draft pass over rows x prompt tokens that plain
batched decoding never runs. Only the steps after it can repay that, by what each token is predicted to save against
a plain batched step, over the tokens the call may still generate. On a CPU where a batch of 4 makes the target's
pass over 4 tokens cost what 1 does, the saving per token is small, and over a short call (48 new tokens) the
draft's prefill alone outweighs it: such a call is better decoded by Transformers' own loop from the start.

The call also lasts as long as its slowest row, and rows accept unevenly: prompts differ. Priced with every row at
the plan's acceptance, the steps' saving is the mean row's, which the call never sees; it is priced with the slowest
row's tokens per step, `SLOWEST_ROW_SHARE` of the rows' mean until a call of the batch size measures it
(`PlainGuard.observe_call`).

What is predicted is not what a call measures: the curves, the acceptance prior and the draft's prefill are each off
by 10-25% on a given call. A call whose predicted net saving is a few percent of its decoding is a coin toss that can
lose to plain batched decoding by 10%, so it must be predicted to save `PRICING_MARGIN` of plain decoding's time,
after the draft's prefill, to speculate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: the slowest row's tokens per speculative step as a share of the rows' mean, before a batch call has measured it:
#: 0.71, the median over 51 calls of the real pair (int8 draft) on HumanEval prompts 0..B-1, 48 new tokens, `chain`
#: and `sequoia` (B = 2: 0.71, 4: 0.69, 8: 0.77; range 0.58-0.80; `studies.slowest_row_share`), rounded down.
#: Priced at the mean row, a call of 8 rows on a 2-core Zen 3 was predicted to save 19.6 s against the draft's 6.3 s
#: prompt pass, and lost to plain batched decoding (0.93x). Priced at this share the saving is 9.4 s, still above
#: it: that call is a near-tie there (0.87-1.06x over runs), which `PRICING_MARGIN` leaves to plain decoding.
SLOWEST_ROW_SHARE = 0.7

#: the net saving (the steps' saving less the draft's prefill) a call must be predicted to make, as a share of plain
#: batched decoding's predicted time over its tokens, to speculate. On a 2-core Zen 3 (real pair, float32 target,
#: int8 draft, 48 new tokens a row) 8-row calls predicted to save 7% of it measured 0.87-1.06x of plain batched
#: decoding over three sessions (a forced one: the draft's prefill 23% dearer than predicted, plain steps 20%);
#: 4-row calls predicted to save 17% measured 1.13-1.41x once the prompts were in the cache, 2-row calls (34%)
#: 1.42-1.62x. 10%, the single sequence's guard margin (`PlainGuard.margin`), parts them.
PRICING_MARGIN = 0.1


def slowest_row_share(row_rates: Sequence[float]) -> float | None:
    """The least of `row_rates` (each row's tokens per speculative step) over their mean; None under 2 rows."""
    rates = [rate for rate in row_rates if rate > 0]
    return min(rates) / (sum(rates) / len(rates)) if len(rates) > 1 else None


def saving_per_token(per_token: np.ndarray) -> tuple[int, float]:
    """(index of the cheapest shape, seconds it saves per token against index 0, the plain step), from every menu
    shape's predicted seconds per token (`ShapeMenu.seconds_per_token`); (0, 0.0) where nothing beats plain."""
    best = int(np.argmin(per_token))
    return best, float(per_token[0] - per_token[best]) if best else 0.0


def call_pays(per_token: np.ndarray, new_tokens: int, setup_seconds: float, margin: float = PRICING_MARGIN) -> bool:
    """Whether drafting the call's best shape is predicted to repay `setup_seconds` (the draft's prefill) over the
    call's `new_tokens` (every row's, at most) before it ends, with `margin` of plain decoding's time to spare."""
    best, saving = saving_per_token(per_token)
    return best != 0 and saving * new_tokens - setup_seconds > margin * per_token[0] * new_tokens
