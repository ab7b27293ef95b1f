"""A chain's confidence threshold learned during the call, as Transformers' assisted generation learns its
`assistant_confidence_threshold` when scikit-learn is installed.

Every drafted token whose draft probability p was read is a sample: kept by the target (1) or the first one
rejected (0); tokens after a rejection say nothing and are not samples. After every step the threshold becomes the
t with the least cost

    cost(t) = FP(t) / negatives + 3 * FN(t) / positives

over the samples so far, where a sample counts as "drafted on" when p >= t: a rejected token drafted on wastes a
draft pass and a target row (FP), a kept token stopped at wastes a whole step (FN, weighted 3). Candidates are the
samples' probabilities and +inf (draft one token only); ties go to the highest t. Nothing is learned before there
are more than 5 samples of both kinds.
"""

from __future__ import annotations

import math

#: what stopping before a token the target keeps costs, against drafting one it rejects (Transformers' weights)
FALSE_STOP_WEIGHT = 3.0
MIN_SAMPLES = 5


def least_cost_threshold(probs: list[float], kept: list[bool]) -> float:
    """The threshold of least cost over samples `probs` (draft probabilities) and `kept` (their verdicts); both kinds
    must be present."""
    positives = sum(kept)
    negatives = len(kept) - positives
    best, best_cost = math.inf, FALSE_STOP_WEIGHT  # +inf: nothing drafted on, every kept token a false stop
    true_pos = false_pos = 0
    ranked = sorted(zip(probs, kept), reverse=True)
    for i, (p, is_kept) in enumerate(ranked):
        true_pos += is_kept
        false_pos += not is_kept
        if i + 1 < len(ranked) and ranked[i + 1][0] == p:
            continue  # a threshold keeps or drops equal probabilities together
        cost = false_pos / negatives + FALSE_STOP_WEIGHT * (positives - true_pos) / positives
        if cost < best_cost:
            best, best_cost = p, cost
    return best


class LearnedThreshold:
    """The threshold of one call: starts at `threshold`, moves to the least-cost one as verdicts come in."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.probs: list[float] = []
        self.kept: list[bool] = []

    def observe(self, probs: list[float], accepted: int) -> None:
        """A step drafted tokens with draft probabilities `probs` (root side first, as many as were read) and the
        target kept the first `accepted` of its tokens."""
        kept, rejected = min(accepted, len(probs)), int(len(probs) > accepted)
        self.probs += probs[: kept + rejected]
        self.kept += [True] * kept + [False] * rejected
        if len(self.probs) > MIN_SAMPLES and 0 < sum(self.kept) < len(self.kept):
            self.threshold = least_cost_threshold(self.probs, self.kept)
