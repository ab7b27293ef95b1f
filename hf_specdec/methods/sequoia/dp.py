"""Sequoia tree planning: the tree shape that maximises expected accepted tokens per target step.

Positional acceptance model (Sequoia, NeurIPS'24): the child drafted r-th under a node is the accepted one
with probability `p[r-1]` given its parent was accepted, whatever the depth. A tree's expected tokens per
step is then the sum over nodes of the product of `p[rank - 1]` along the root-to-node path (root = 1).

Let f(m, l) be the best value of a tree of at most m nodes and at most l levels, and g(k, l', r) the best
value of children of rank r, r+1, ... sharing k nodes, each child subtree having at most l' levels:

    f(m, l)    = 1 + g(m - 1, l - 1, 1)                            (f(1, l) = 1, f(m, 0) = f(0, l) = 0)
    g(k, l', r) = max_{1 <= s <= k} p_r f(s, l') + g(k - s, l', r + 1)    (g(0, ., .) = g(., ., W + 1) = 0)

g(k) only needs g(k - s) for s >= 1 and f(s <= k), so we sweep k = 1..n once and handle every (l', r)
pair of a given k with one max-plus reduction: O(n^2 d W / 2) flops in n vectorised steps. Only values are
kept; the argmax is recomputed for the at most n cells that the optimal tree visits.

When p is non-increasing (the usual case: the first-drafted child is the likeliest), the DP is not needed: a
node is never worth more than its parent or its earlier siblings, so the best tree of at most m nodes is the m
most probable nodes, and popping them from a heap (a child becomes available once its parent and its previous
sibling are taken) finds it in O(m W log m). One run gives the best tree of every size up to m at once.
"""

from __future__ import annotations

import heapq
import json
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...core.tree import TokenTree, breadth_first_order, renumber_parents, reorder
from ...plan.shapes import validate_acceptance, validate_parents
from ...runtime.paths import json_object


def _check_limits(budget: int, max_depth: int) -> None:
    if int(budget) != budget or budget < 1:
        raise ValueError(f"budget is the max number of tree nodes including the root; it must be >= 1, got {budget!r}.")
    if int(max_depth) != max_depth or max_depth < 1:
        raise ValueError(f"max_depth counts levels including the root; it must be >= 1, got {max_depth!r}.")


@dataclass
class _Tables:
    """DP state: f[m, l], g_rev[n-1-k, l', r-1] = g(k, l', r) (rank W+1 column = 0), pf[s, l', r-1] = p_r f(s, l')."""

    f: np.ndarray
    g_rev: np.ndarray
    pf: np.ndarray


def _solve(acceptance: list[float], budget: int, max_depth: int) -> _Tables:
    """Fill f and g for every (m <= n, l <= d); values only, argmaxes are recomputed on the few cells a plan visits."""
    n, d, w = budget, max_depth, len(acceptance)
    p = torch.tensor(acceptance, dtype=torch.float64)
    f = torch.zeros(n + 1, d + 1, dtype=torch.float64)
    f[1, 1:] = 1.0
    # g is stored row-reversed so that g(k-1), ..., g(0) is one ascending slice. Child levels l' run over 0..d-1
    # (no tree of at most d levels has a child subtree of d levels).
    g_rev = torch.zeros(n, d, w + 1, dtype=torch.float64)
    pf = torch.zeros(n + 1, d, w, dtype=torch.float64)
    pf[1] = p * f[1, :d, None]
    scratch = torch.empty(n, d, w, dtype=torch.float64)
    for k in range(1, n):
        cand = torch.add(pf[1 : k + 1], g_rev[n - k :, :, 1:], out=scratch[:k])  # child of rank r takes s = 1..k
        g_rev[n - 1 - k, :, :w] = cand.amax(dim=0)
        f[k + 1, 1:] = 1.0 + g_rev[n - 1 - k, :, 0]  # f(k+1, l) = 1 + g(k, l-1, 1)
        pf[k + 1] = p * f[k + 1, :d, None]
    return _Tables(f.numpy(), g_rev.numpy(), pf.numpy())


def _reconstruct(t: _Tables, budget: int, max_depth: int) -> list[int]:
    """Breadth-first walk down the optimum: each queued node knows its node budget and level budget.

    Works for any `budget` and `max_depth` up to the sizes the tables were solved for.
    """
    n, width = t.g_rev.shape[0], t.pf.shape[2]
    parents: list[int] = [-1]
    queue = deque([(0, budget, max_depth)])
    while queue:
        node, m, levels = queue.popleft()
        k, rank, lc = m - 1, 1, levels - 1
        while lc > 0 and k > 0 and rank <= width:
            s = 1 + int(np.argmax(t.pf[1 : k + 1, lc, rank - 1] + t.g_rev[n - k :, lc, rank]))  # same sums as the DP
            parents.append(node)
            queue.append((len(parents) - 1, s, lc))
            k, rank = k - s, rank + 1
    return parents


def _path_probs(parents: list[int], acceptance: Sequence[float]) -> list[float]:
    """Probability that each node is reached (root = 1), with rank = position among its siblings."""
    probs, seen = [1.0], {}
    for i in range(1, len(parents)):
        rank = seen.get(parents[i], 0)
        seen[parents[i]] = rank + 1
        probs.append(probs[parents[i]] * (acceptance[rank] if rank < len(acceptance) else 0.0))
    return probs


def _prune_zero_nodes(parents: list[int], acceptance: Sequence[float]) -> list[int]:
    """Drop nodes worth nothing: zero reach probability and no later sibling worth something (ranks stay put)."""
    probs = _path_probs(parents, acceptance)
    keep, later_positive = [True] * len(parents), {}
    for i in range(len(parents) - 1, 0, -1):  # siblings are contiguous, walk them last rank first
        later_positive[parents[i]] = later_positive.get(parents[i], False) or probs[i] > 0
        keep[i] = later_positive[parents[i]]
    return renumber_parents(torch.tensor(parents), torch.nonzero(torch.tensor(keep)).flatten()).tolist()


def expected_tokens(parents: Sequence[int], acceptance: Sequence[float]) -> float:
    """Expected tokens per target step of any tree in the parents format (root included, so >= 1)."""
    parents = [int(x) for x in parents]
    validate_parents(parents)
    return float(sum(_path_probs(parents, validate_acceptance(acceptance))))


def expected_tokens_table(acceptance: Sequence[float], budget: int, max_depth: int) -> np.ndarray:
    """E*[m, l]: best expected tokens with at most m nodes and at most l levels; shape (budget+1, max_depth+1)."""
    _check_limits(budget, max_depth)
    return _solve(validate_acceptance(acceptance), int(budget), int(max_depth)).f


@dataclass(frozen=True)
class TreePlan:
    """A planned tree shape plus the inputs it was planned for, storable as JSON (never pickle)."""

    parents: list[int]
    expected_tokens: float
    acceptance: list[float]
    budget: int
    max_depth: int

    def widths_per_level(self) -> list[int]:
        """Number of nodes at each level, root level first (so it sums to the node count)."""
        depths = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depths[i] = depths[self.parents[i]] + 1
        return np.bincount(depths).tolist()

    def to_dict(self) -> dict:
        return {
            "expected_tokens": self.expected_tokens,
            "parents": list(self.parents),
            "budget": self.budget,
            "max_depth": self.max_depth,
            "acceptance": list(self.acceptance),
            "widths_per_level": self.widths_per_level(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> TreePlan:
        """Read a plan checked by value, not only by structure: a stored tree is drafted as written, so a tree
        larger or deeper than its own limits, or an impossible expectation, must not get that far."""
        data = json_object(data, "A tree plan")
        parents = [int(x) for x in data["parents"]]
        validate_parents(parents)
        plan = cls(
            parents=parents,
            expected_tokens=float(data["expected_tokens"]),
            acceptance=validate_acceptance(data["acceptance"]),
            budget=int(data["budget"]),
            max_depth=int(data["max_depth"]),
        )
        plan.check_limits()
        return plan

    def check_limits(self) -> None:
        """Raise ValueError unless the tree fits its budget and depth and its expectation is a possible one."""
        _check_limits(self.budget, self.max_depth)
        levels = len(self.widths_per_level())
        if len(self.parents) > self.budget or levels > self.max_depth:
            raise ValueError(
                f"The tree has {len(self.parents)} nodes over {levels} levels, beyond its own budget {self.budget} "
                f"and max_depth {self.max_depth}: re-plan it (`hf-specdec calibrate`) or fix those limits."
            )
        if not 1.0 <= self.expected_tokens <= len(self.parents) + 1e-9:  # `not` also catches NaN
            raise ValueError(
                f"expected_tokens {self.expected_tokens!r} is impossible for a tree of {len(self.parents)} nodes "
                "(between 1, the root alone, and the node count): re-plan it."
            )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> TreePlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> TreePlan:
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(fh.read())


def _is_non_increasing(p: Sequence[float]) -> bool:
    return all(a >= b for a, b in zip(p, p[1:]))


def _most_probable_nodes(acceptance: list[float], budget: int, max_depth: int) -> tuple[list[int], list[float]]:
    """The `budget` most probable nodes within `max_depth` levels, in the order a heap pops them.

    Returns (parent of each popped node as a pop index, -1 for the root; path probability of each). Valid for a
    non-increasing acceptance vector; zero-probability nodes are never taken.
    """
    parents, probs = [-1], [1.0]
    depth_of = [1]
    heap: list[tuple[float, int, int, int]] = []  # (-probability, tie-breaker, parent pop index, rank)
    counter = 0

    def offer(parent: int, rank: int) -> None:
        nonlocal counter
        prob = probs[parent] * acceptance[rank] if rank < len(acceptance) else 0.0
        if prob > 0 and depth_of[parent] < max_depth:  # prob > 0 also drops products that underflow
            heapq.heappush(heap, (-prob, counter, parent, rank))
            counter += 1

    offer(0, 0)
    while heap and len(parents) < budget:
        neg, _, parent, rank = heapq.heappop(heap)
        parents.append(parent)
        probs.append(-neg)
        depth_of.append(depth_of[parent] + 1)
        offer(len(parents) - 1, 0)  # its first child
        offer(parent, rank + 1)  # its next sibling
    return parents, probs


def _breadth_first(pop_parents: list[int]) -> list[int]:
    """Renumber popped nodes breadth first; siblings keep their rank order (they were popped in rank order)."""
    tree = TokenTree.from_parents(torch.zeros(len(pop_parents), dtype=torch.long), pop_parents)
    order = breadth_first_order(tree.parents, tree.depths, priority=-torch.arange(len(pop_parents)))
    return reorder(tree.parents, order).tolist()


class TreePlanner:
    """Plan trees of any size up to `max_budget` nodes and `max_depth` levels for one acceptance vector.

    Hardware-aware sizing compares many (budget, depth) pairs: a non-increasing vector is served by the heap
    (one run per depth covers every budget), any other by one DP solve for the largest sizes.
    """

    def __init__(self, acceptance: Sequence[float], max_budget: int, max_depth: int) -> None:
        _check_limits(max_budget, max_depth)
        self.acceptance = validate_acceptance(acceptance)
        self.max_budget, self.max_depth = int(max_budget), int(max_depth)
        self.greedy = _is_non_increasing(self.acceptance)
        self._tables = None if self.greedy else _solve(self.acceptance, self.max_budget, self.max_depth)
        self._popped: dict[int, tuple[list[int], list[float]]] = {}

    @property
    def table(self) -> np.ndarray:
        """E*[m, l] for m <= max_budget nodes and l <= max_depth levels (see `expected_tokens_table`)."""
        if self._tables is not None:
            return self._tables.f
        table = np.zeros((self.max_budget + 1, self.max_depth + 1))
        for depth in range(1, self.max_depth + 1):
            probs = np.cumsum(self._pop(depth)[1])
            table[1:, depth] = probs[np.minimum(np.arange(self.max_budget), len(probs) - 1)]
        return table

    def _pop(self, max_depth: int) -> tuple[list[int], list[float]]:
        if max_depth not in self._popped:
            self._popped[max_depth] = _most_probable_nodes(self.acceptance, self.max_budget, max_depth)
        return self._popped[max_depth]

    def plan(self, budget: int, max_depth: int) -> TreePlan:
        _check_limits(budget, max_depth)
        if budget > self.max_budget or max_depth > self.max_depth:
            raise ValueError(
                f"This planner covers budgets up to {self.max_budget} and depths up to {self.max_depth}; "
                f"asked for {budget} and {max_depth}: build a TreePlanner with larger limits."
            )
        if self.greedy:
            pop_parents, probs = self._pop(max_depth)
            parents = _breadth_first(pop_parents[:budget])
            value = float(sum(probs[:budget]))
        else:
            parents = _prune_zero_nodes(_reconstruct(self._tables, int(budget), int(max_depth)), self.acceptance)
            value = float(self._tables.f[budget, max_depth])
        return TreePlan(parents, value, self.acceptance, int(budget), int(max_depth))


def plan_tree(acceptance: Sequence[float], budget: int, max_depth: int) -> TreePlan:
    """The tree of at most `budget` nodes and `max_depth` levels (root included) maximising expected tokens."""
    return TreePlanner(acceptance, budget, max_depth).plan(budget, max_depth)
