"""Trees sized every step: grow while one more draft pass is predicted to lower the time per token, then hand the
target the prefix of the tree that minimises it.

A drafted node v is accepted with probability a(v) = a(parent) * f(q_v), where q_v is the draft's probability of
v's token under its parent and f maps it to how often the target agrees (learned online, `OnlineAcceptance`).
With the nodes sorted by a, the best tree of n nodes is the n first ones (a child never outranks its parent), and

    time per token(n) = (draft seconds spent + t_target(n)) / (1 + sum of the n - 1 best a(v))

from the measured latency curves. Another draft pass over the w best unexpanded nodes costs t_draft(w) and is
expected to add g * (their a) accepted tokens, g being what an expansion's children have added so far (learned).
The drafter keeps growing only while that lowers the best time per token: a confident draft grows deep trees, an
unsure one stops after the root's pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .sizing import HardwareProfile

#: frontier sizes a pass may take, tried every step (a pass over a few more tokens costs little more on a CPU)
FRONTIER_SIZES = (1, 2, 4, 8, 16, 32)


class OnlineAcceptance:
    """P(target keeps a drafted child | it kept the parent) against the draft's probability q of that child.

    Binned on log q; every bin starts at a prior worth `prior_weight` observations centred on q itself (a calibrated
    draft) and learns from every verified step. Read as non-decreasing in q: a likelier draft token never rates lower.
    """

    def __init__(self, bins: int = 16, min_prob: float = 1e-4, prior_weight: float = 4.0) -> None:
        self.edges = torch.linspace(math.log(min_prob), 0.0, bins + 1)[1:-1]
        centres = torch.linspace(math.log(min_prob), 0.0, 2 * bins + 1)[1::2].exp()
        self.trials = torch.full((bins,), prior_weight, dtype=torch.float64)
        self.hits = centres.double() * prior_weight
        self.observations = 0

    def _bins(self, logq: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(logq.float().clamp(max=0.0), self.edges)

    def rates(self) -> torch.Tensor:
        """Acceptance rate of each bin, made non-decreasing from the lowest q up."""
        return torch.cummax(self.hits / self.trials, dim=0).values

    def __call__(self, logq: torch.Tensor) -> torch.Tensor:
        """log f(q) for draft log-probabilities `logq` (any shape); -inf stays -inf (a banned token)."""
        logf = self.rates().log()[self._bins(logq)].to(logq.dtype)
        return torch.where(torch.isfinite(logq), logf, logq)

    def update(self, logq: torch.Tensor, accepted: torch.Tensor) -> None:
        """Learn from children of reached nodes: their draft log-probabilities and whether the target kept them."""
        bins = self._bins(logq)
        self.trials.index_add_(0, bins, torch.ones(len(bins), dtype=torch.float64))
        self.hits.index_add_(0, bins, accepted.double())
        self.observations += len(bins)


@dataclass
class StepSizer:
    """The cost model a best-first drafter consults after every pass (see the module doc).

    The latency curves are corrected by what passes really take while generating (a running mean of the log of
    measured over predicted time, per model): a curve measured on a busy machine, or before something changed,
    stops steering the trees after a few steps.
    """

    profile: HardwareProfile
    acceptance: OnlineAcceptance = field(default_factory=OnlineAcceptance)
    expansion_gain: float = 0.5  # g: accepted tokens an expansion's children add per unit of the parent's a (learned)
    gain_memory: float = 0.9  # weight of the past in g's running mean
    timing_memory: float = 0.7  # weight of the past in the latency corrections
    target_scale: float = 1.0  # measured / predicted target pass time (running, geometric)
    draft_scale: float = 1.0  # measured / predicted draft pass time

    def target_seconds(self, n):
        return self.target_scale * self.profile.target(n)

    def draft_seconds(self, n):
        return self.draft_scale * self.profile.draft(n)

    def observe_target(self, tokens: int, seconds: float) -> None:
        self.target_scale = self._corrected(self.target_scale, seconds, self.profile.target(tokens))

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self.draft_scale = self._corrected(self.draft_scale, seconds, self.profile.draft(tokens))

    def _corrected(self, scale: float, measured: float, predicted: float) -> float:
        if measured <= 0 or predicted <= 0:
            return scale
        log_scale = self.timing_memory * math.log(scale) + (1 - self.timing_memory) * math.log(measured / predicted)
        return math.exp(log_scale)

    def best_size(self, values: torch.Tensor, draft_seconds: float) -> tuple[int, float]:
        """(nodes incl. the root, predicted seconds per token) of the best prefix of `values` (non-root a(v), sorted
        descending) after `draft_seconds` of drafting."""
        expected = 1.0 + torch.cat([values.new_zeros(1), values.double().cumsum(0)]).numpy()
        sizes = torch.arange(1, len(values) + 2).numpy()
        per_token = (draft_seconds + self.target_seconds(sizes) + self.profile.step_overhead) / expected
        best = int(per_token.argmin())
        return best + 1, float(per_token[best])

    def plain_seconds(self) -> float:
        """Predicted seconds of a plain step (the root alone, no draft pass): what every tree must beat per token."""
        return float(self.target_seconds(1)) + self.profile.step_overhead

    def _after_pass(self, values: torch.Tensor, size: int, open_values: torch.Tensor, draft_seconds: float) -> float:
        """Predicted seconds per token once one more draft pass expands all of `open_values`."""
        expected = 1.0 + float(values[: size - 1].sum()) + self.expansion_gain * float(open_values.sum())
        seconds = draft_seconds + self.draft_seconds(len(open_values)) + self.target_seconds(size + len(open_values))
        return (seconds + self.profile.step_overhead) / expected

    def next_frontier(
        self, values: torch.Tensor, open_values: torch.Tensor, draft_seconds: float
    ) -> int:
        """How many of the best open nodes (values `open_values`, sorted descending) the next draft pass should
        expand; 0 when no pass is predicted to lower the time per token."""
        size, best = self.best_size(values, draft_seconds)
        choice = 0
        for width in FRONTIER_SIZES:
            width = min(width, len(open_values))
            per_token = self._after_pass(values, size, open_values[:width], draft_seconds)
            if per_token < best:
                best, choice = per_token, width
            if width == len(open_values):
                break
        return choice

    def observe_expansion(self, parent_values: torch.Tensor, children_values: torch.Tensor) -> None:
        """An expansion added `children_values` (each row: the children of one parent): update g."""
        ratio = float(children_values.sum() / parent_values.sum().clamp(min=1e-12))
        self.expansion_gain = self.gain_memory * self.expansion_gain + (1 - self.gain_memory) * ratio
