"""Whether speculation pays for a whole batch call, not only step by step.

Before its first tree the draft must read every row's prompt: one draft pass over rows x prompt tokens that plain
batched decoding never runs. Only the steps after it can repay that, by what each token is predicted to save against
a plain batched step, over the tokens the call may still generate. On a CPU where a batch of 4 makes the target's
pass over 4 tokens cost what 1 does, the saving per token is small, and over a short call (48 new tokens) the
draft's prefill alone outweighs it: such a call is better decoded by Transformers' own loop from the start.
"""

from __future__ import annotations

import numpy as np


def saving_per_token(per_token: np.ndarray) -> tuple[int, float]:
    """(index of the cheapest shape, seconds it saves per token against index 0, the plain step), from every menu
    shape's predicted seconds per token (`ShapeMenu.seconds_per_token`); (0, 0.0) where nothing beats plain."""
    best = int(np.argmin(per_token))
    return best, float(per_token[0] - per_token[best]) if best else 0.0


def call_pays(per_token: np.ndarray, new_tokens: int, setup_seconds: float) -> bool:
    """Whether drafting the call's best shape is predicted to repay `setup_seconds` (the draft's prefill) over the
    call's `new_tokens` (every row's, at most) before it ends."""
    best, saving = saving_per_token(per_token)
    return best != 0 and saving * new_tokens > setup_seconds
