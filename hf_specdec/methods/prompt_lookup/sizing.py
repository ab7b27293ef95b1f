"""Prompt-lookup trees sized every step: keep the nodes that pay for the target's longer pass, none if none do.

A looked-up node v is kept by the target with probability a(v) = a(parent) f(v), f learned online as a hit rate
per kind of node: whether v is a match's first token (the uncertain one) or below a kept one, and whether most of
its parent's matches continue with v (share q_v >= 1/2). Not `OnlineAcceptance`'s curve over q: most looked-up
nodes have q = 1, and a curve kept non-decreasing in q cannot learn that they are refused. With no draft pass
to pay for, a tree of n nodes costs only the target's pass, modelled as t(n) = t(1) (1 + s (n - 1)), so

    n* = argmin over n of (1 + s (n - 1)) / (1 + sum of the n - 1 best a(v))

and n* = 1 (the root alone) is a plain step. The relative slope s is fitted online from the passes the loop times
(weighted least squares of seconds on n, the past forgotten geometrically), starting from `prior_slope`. What a call
learns carries over to the next call on the same target (`learned_sizer`), as a draft's acceptance curve does.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class PassSlope:
    """s in t(n) = t(1) (1 + s (n - 1)), fitted from measured (n, seconds) pairs; `prior_slope` until two sizes
    have been seen (a CPU here: about 0.03; a GPU: near 0 over a few dozen tokens)."""

    prior_slope: float = 0.03
    memory: float = 0.95  # weight of the past per observation
    _sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # weights, n, t, n², n·t

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self._sums = self.memory * self._sums + np.array([1.0, tokens, seconds, tokens * tokens, tokens * seconds])

    @property
    def slope(self) -> float:
        weight, n, t, nn, nt = self._sums
        spread = weight * nn - n * n
        if weight <= 0 or spread < 0.5 * weight * weight:  # sizes seen vary by less than about one token
            return self.prior_slope
        per_token = (weight * nt - n * t) / spread
        single = (t - per_token * n) / weight + per_token  # t(1)
        return float(min(max(per_token / single, 0.0), 1.0)) if single > 0 else self.prior_slope


def _kind(parent: int, share: float) -> int:
    """0..3: (a match's first token or below one) x (a minority or a majority of the parent's matches)."""
    return 2 * (parent != 0) + (share >= 0.5)


@dataclass
class LookupSizer:
    """The cost model a prompt-lookup drafter consults before each proposal (see the module doc)."""

    slope: PassSlope = field(default_factory=PassSlope)
    # hits and trials per kind of node, from a prior worth two observations: first tokens uncertain, deeper likelier
    hits: np.ndarray = field(default_factory=lambda: np.array([0.4, 1.0, 1.0, 1.6]))
    trials: np.ndarray = field(default_factory=lambda: np.full(4, 2.0))

    def values(self, parents: Sequence[int], shares: Sequence[float]) -> list[float]:
        """a(v) of every node (1 at the root); parents precede their children."""
        rates = self.hits / self.trials
        values = [1.0] * len(parents)
        for node in range(1, len(parents)):
            parent = parents[node]
            values[node] = values[parent] * float(rates[_kind(parent, shares[node])])
        return values

    def best_size(self, sorted_values: Sequence[float]) -> int:
        """Nodes (root included) of the best tree, given the non-root a(v) sorted descending."""
        expected = 1.0 + np.array([0.0, *itertools.accumulate(sorted_values)])
        cost = 1.0 + self.slope.slope * np.arange(len(expected))
        return int((cost / expected).argmin()) + 1

    def learn(self, parents: Sequence[int], shares: Sequence[float], path: Sequence[int]) -> None:
        """The target kept `path` (root first) of the tree verified: every child of a kept node teaches f."""
        reached = set(path)
        for node in range(1, len(parents)):
            if parents[node] in reached:
                kind = _kind(parents[node], shares[node])
                self.trials[kind] += 1.0
                self.hits[kind] += node in reached


_LEARNED: weakref.WeakKeyDictionary[torch.nn.Module, LookupSizer] = weakref.WeakKeyDictionary()


def learned_sizer(target: torch.nn.Module) -> LookupSizer:
    """The cost model learned so far for prompt lookup on `target` (pass costs and hit rates): calls that follow
    one another keep learning instead of starting from the prior."""
    return _LEARNED.setdefault(target, LookupSizer())
