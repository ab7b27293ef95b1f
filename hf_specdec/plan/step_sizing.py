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

import itertools
import math
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessorList, PreTrainedModel

from .sizing import HardwareProfile

#: frontier sizes a pass may take, tried every step (a pass over a few more tokens costs little more on a CPU)
FRONTIER_SIZES = (1, 2, 4, 8, 16, 32)


class OnlineAcceptance:
    """P(target keeps a drafted child | it kept the parent) against the draft's probability q of that child.

    Binned on log q below q = 1/2 and on log(1 - q) above it (`confident_bins` bins, each halving 1 - q): a confident
    draft gives most tokens q > 0.9, and one bin over q in [0.56, 1] (equal steps of log q all the way) rated a 0.99
    token as a 0.6 one, so best-first growth could not tell a sure continuation from an unsure sibling and priced
    deep chains low. Every bin starts at a prior worth `prior_weight` observations centred on q itself (a
    calibrated draft) and learns from every verified step. Read as non-decreasing in q: a likelier draft token never
    rates lower. Its state is host numbers (the drafters learn from what the step already read); `__call__` rates
    device tensors where they are, `log_rates` host lists, by the same bins (float32 log q, `bucketize`'s rule).
    """

    def __init__(self, bins: int = 14, min_prob: float = 1e-4, prior_weight: float = 4.0,
                 confident_bins: int = 7) -> None:
        low = np.linspace(math.log(min_prob), math.log(0.5), bins + 1)  # bin edges on log q, up to q = 1/2
        doubt = 0.5 ** np.arange(1, confident_bins + 1)  # 1 - q at the confident bins' edges: 1/2, 1/4, ...
        bounds = np.concatenate([np.exp(low), 1.0 - doubt[1:], [1.0]])  # q at every bin's edges
        self.edges = np.log(bounds[1:-1]).astype(np.float32)
        centres = np.sqrt(bounds[:-1] * bounds[1:])  # geometric middles, but the top bin's: half its lower edge's 1 - q
        centres[-1] = 1.0 - doubt[-1] / 2
        self.trials = np.full(len(centres), prior_weight, dtype=np.float64)
        self.hits = centres * prior_weight
        self.observations = 0
        self._tables: dict[torch.device, tuple[int, torch.Tensor, torch.Tensor]] = {}  # see `_device_tables`

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(log rates, edges)` on `device`, copied again only after `update` (once a step, not at every rating)."""
        found = self._tables.get(device)
        if found is None or found[0] != self.observations:
            found = (self.observations, torch.from_numpy(np.log(self.rates())).to(device, non_blocking=True),
                     torch.from_numpy(self.edges).to(device, non_blocking=True))
            self._tables[device] = found
        return found[1], found[2]

    def _bins(self, logq) -> np.ndarray:
        return np.searchsorted(self.edges, np.minimum(np.asarray(logq, dtype=np.float32), 0.0))

    def rates(self) -> np.ndarray:
        """Acceptance rate of each bin, made non-decreasing from the lowest q up by pooling neighbours that disagree,
        weighted by their trials (`non_decreasing`). A running maximum would let the prior of a bin never visited
        outrank what hundreds of verdicts said of the bin above it: a draft sure (q near 1) of tokens the target
        rejects kept a rate near 1 and drafted on."""
        return non_decreasing(self.hits / self.trials, self.trials)

    def __call__(self, logq: torch.Tensor) -> torch.Tensor:
        """log f(q) for draft log-probabilities `logq` (any shape, any device; no read); -inf stays -inf."""
        log_rates, edges = self._device_tables(logq.device)
        logf = log_rates[torch.bucketize(logq.float().clamp(max=0.0), edges)].to(logq.dtype)
        return torch.where(torch.isfinite(logq), logf, logq)

    def log_rates(self, logq: list[float]) -> list[float]:
        """`__call__` for host numbers."""
        logf = np.log(self.rates())[self._bins(logq)]
        return [float(f) if math.isfinite(q) else q for f, q in zip(logf, logq)]

    def update(self, logq: list[float], accepted: list[bool]) -> None:
        """Learn from children of reached nodes: their draft log-probabilities and whether the target kept them."""
        bins = self._bins(logq)
        np.add.at(self.trials, bins, 1.0)
        np.add.at(self.hits, bins, np.asarray(accepted, dtype=np.float64))
        self.observations += len(bins)


def non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit of `values` (isotonic regression, pool adjacent violators):
    each run of neighbours out of order becomes their weighted mean."""
    blocks: list[list[float]] = []  # [weighted mean, weight, length]
    for value, weight in zip(values.tolist(), weights.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (high, w_high, n_high), (low, w_low, n_low) = blocks[-2], blocks.pop()
            blocks[-1] = [(high * w_high + low * w_low) / (w_high + w_low), w_high + w_low, n_high + n_low]
    return np.repeat([block[0] for block in blocks], [block[2] for block in blocks])


_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def learned_acceptance(draft_model: PreTrainedModel, key: Hashable) -> OnlineAcceptance:
    """The acceptance curve learned so far for this draft and `key` (its target and logits processors): calls that
    follow one another keep learning instead of starting from the prior."""
    return _LEARNED.setdefault(draft_model, {}).setdefault(key, OnlineAcceptance())


def processors_key(processors: LogitsProcessorList | None) -> tuple:
    """What of the logits processors changes acceptance: their types and sampling settings."""
    names = ("temperature", "top_k", "top_p", "min_p", "penalty")
    return tuple((type(p).__name__, *(getattr(p, n, None) for n in names)) for p in processors or [])


def _floats(values) -> list[float]:
    """Values as host floats (the drafters hand lists; a tensor is read here)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


@dataclass
class StepSizer:
    """The cost model a best-first drafter consults after every pass (see the module doc).

    The latency curves are corrected by what passes really take while generating (a running mean of the log of
    measured over predicted time, per model): a curve measured on a busy machine, or before something changed,
    stops steering the trees after a few steps. One correction serves every size: on a 2-core Xeon (AMX) the same
    6-node pass measured 0.90 to 1.77 times its curve within one call, so a mean per size would follow the machine's
    noise. What the sizer does keep per size is the largest target pass it has timed (`largest_timed`): a smaller
    tree's cost is bounded by one it measured, a larger one's is the curve's word alone (`ShapeChooser` probes it).
    """

    profile: HardwareProfile
    acceptance: OnlineAcceptance = field(default_factory=OnlineAcceptance)
    expansion_gain: float = 0.5  # g: accepted tokens an expansion's children add per unit of the parent's a (learned)
    gain_memory: float = 0.9  # weight of the past in g's running mean
    timing_memory: float = 0.7  # weight of the past in the latency corrections
    target_scale: float = 1.0  # measured / predicted target pass time (running, geometric)
    draft_scale: float = 1.0  # measured / predicted draft pass time
    largest_timed: int = 0  # the most nodes a target pass this sizer timed had (0: none yet)

    def target_seconds(self, n):
        return self.target_scale * self.profile.target(n)

    def draft_seconds(self, n):
        return self.draft_scale * self.profile.draft(n)

    def observe_target(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.largest_timed = max(self.largest_timed, int(tokens))
        self.target_scale = self._corrected(self.target_scale, seconds, self.profile.target(tokens))

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self.draft_scale = self._corrected(self.draft_scale, seconds, self.profile.draft(tokens))

    def _corrected(self, scale: float, measured: float, predicted: float) -> float:
        if measured <= 0 or predicted <= 0:
            return scale
        log_scale = self.timing_memory * math.log(scale) + (1 - self.timing_memory) * math.log(measured / predicted)
        return math.exp(log_scale)

    @property
    def max_nodes(self) -> int:
        """The largest tree the target's curve was measured for. Past it a pass's cost is a straight-line guess: an
        H200's flat curve (1 to 128 nodes) extended that way priced 2048 nodes like 128, which cost 3x; trees stop."""
        return int(self.profile.target.sizes[-1])

    def best_size(self, values: Sequence[float], draft_seconds: float) -> tuple[int, float]:
        """(nodes incl. the root, predicted seconds per token) of the best prefix of `values` (non-root a(v), sorted
        descending) after `draft_seconds` of drafting, at most `max_nodes` nodes."""
        expected = 1.0 + np.array([0.0, *itertools.accumulate(_floats(values)[: self.max_nodes - 1])])
        sizes = np.arange(1, len(expected) + 1)
        per_token = (draft_seconds + self.target_seconds(sizes) + self.profile.step_overhead) / expected
        best = int(per_token.argmin())
        return best + 1, float(per_token[best])

    def plain_seconds(self) -> float:
        """Predicted seconds of a plain step (the root alone, no draft pass): what every tree must beat per token."""
        return float(self.target_seconds(1)) + self.profile.step_overhead

    def _after_pass(self, values: list[float], size: int, open_values: list[float], draft_seconds: float) -> float:
        """Predicted seconds per token once one more draft pass expands all of `open_values`."""
        expected = 1.0 + math.fsum(values[: size - 1]) + self.expansion_gain * math.fsum(open_values)
        seconds = draft_seconds + self.draft_seconds(len(open_values)) + self.target_seconds(size + len(open_values))
        return (seconds + self.profile.step_overhead) / expected

    def next_frontier(self, values: Sequence[float], open_values: Sequence[float], draft_seconds: float) -> int:
        """How many of the best open nodes (values `open_values`, sorted descending) the next draft pass should
        expand; 0 when no pass is predicted to lower the time per token."""
        values, open_values = _floats(values), _floats(open_values)
        if len(values) + 1 >= self.max_nodes:  # the target verifies no more than that: another pass is wasted
            return 0
        size, best = self.best_size(values, draft_seconds)
        choice, room = 0, min(len(open_values), self.max_nodes - size)  # priced within the measured curve only
        for width in FRONTIER_SIZES:
            width = min(width, room)
            per_token = self._after_pass(values, size, open_values[:width], draft_seconds)
            if per_token < best:
                best, choice = per_token, width
            if width == room:
                break
        return choice

    def observe_expansion(self, parents_total: float, children_total: float) -> None:
        """An expansion added children whose values sum to `children_total` below parents summing to
        `parents_total`: update g."""
        ratio = children_total / max(parents_total, 1e-12)
        self.expansion_gain = self.gain_memory * self.expansion_gain + (1 - self.gain_memory) * ratio
