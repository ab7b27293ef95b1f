"""Planned tree shapes sized every step: of a menu of shapes (the Sequoia DP's best tree for every size and depth,
or the sub-shapes of a fixed one), draft the one with the least predicted time per token under what this call has
learned so far:

    time per token(shape) = (sum over its draft passes t_draft(w) + t_target(n) + overhead) / E(shape; p)

with the `StepSizer`'s latency curves (corrected online by measured target and draft passes) and E the expected
tokens per step of the shape under the positional acceptance vector p (the child drafted r-th under a kept node is
kept with probability p_r) learned while generating (`RankAcceptance`). The root alone, a plain target step with no
draft pass, is always on the menu: a step is never predicted slower than plain, and when nothing beats it the
drafter runs plain steps until the learned acceptance or the corrected curves say a tree pays again.

A batch drafting one shape for every row in lockstep sizes it the same way: the curves as the batch sees them
(`sizing.for_batch`: a pass over n nodes per row costs what rows * n tokens cost) and the tokens every row is
expected to add, each row with its own learned acceptance (`ShapeMenu.best` given one `RankAcceptance` per row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .shapes import validate_acceptance, validate_parents, widths_parents
from .sizing import ROOT_PASS_TOKENS, level_widths_with_children
from .step_sizing import StepSizer


class RankAcceptance:
    """p_r = P(the target keeps the child drafted r-th | it kept the parent), learned from verdicts, in two rows: the
    root's children (row 0) and deeper nodes' (row 1). The first token after a verified one is the draft's hardest
    (real pair, HumanEval greedy: a drafted node's first child kept 0.87 of the time, one vector for both at
    0.72–0.80): one vector priced deep trees at the root's rate.

    Each row starts at `prior` (a plan's calibrated vector) worth `prior_weight` visits per rank, so that a few steps
    move it and a long call follows the prompt. A rank past the prior's end starts at 0 (nothing to gain from it)."""

    def __init__(self, prior: Sequence[float], ranks: int, prior_weight: float = 8.0) -> None:
        p = validate_acceptance(prior)
        self.prior = np.array([p[r] if r < len(p) else 0.0 for r in range(ranks)])
        self.trials = np.full((2, ranks), prior_weight)
        self.hits = np.stack([self.prior, self.prior]) * prior_weight

    def vectors(self) -> np.ndarray:
        """(2, ranks): the rates below the root, then below a drafted node."""
        return self.hits / self.trials

    def update(self, children_of_reached: list[int], accepted_rank: list[int | None],
               below_root: list[bool] | None = None) -> None:
        """For every reached node that had children: how many, which rank the target kept (None: none), and
        whether the node was the root (default: none was)."""
        below_root = below_root or [False] * len(children_of_reached)
        for count, rank, first in zip(children_of_reached, accepted_rank, below_root):
            row = 0 if first else 1
            count = min(count, self.trials.shape[1])
            self.trials[row, :count] += 1
            if rank is not None and rank < self.hits.shape[1]:
                self.hits[row, rank] += 1

    def learn(self, children: list[list[int]], path: list[int], accepted_ranks: list[int]) -> None:
        """Learn from one verdict on a drafted tree: `children` per node (the tree's host copy), the accepted `path`
        (root first) and the rank of each accepted child among its siblings."""
        steps = [(j, node) for j, node in enumerate(path) if children[node]]
        self.update([len(children[node]) for _, node in steps],
                    [accepted_ranks[j] if j + 1 < len(path) else None for j, _ in steps],
                    [j == 0 for j, _ in steps])


def by_depth(acceptance: np.ndarray) -> np.ndarray:
    """Acceptance as (2, ranks) rows (below the root, below a drafted node): one vector serves both."""
    acceptance = np.asarray(acceptance, dtype=float)
    return np.stack([acceptance, acceptance]) if acceptance.ndim == 1 else acceptance


#: one sequence's learned acceptance, or one per row of a batch
Acceptances = RankAcceptance | Sequence[RankAcceptance]


@dataclass(frozen=True)
class ShapeMenu:
    """Candidate shapes (parents lists, BFS order, the root alone first) and what predicting them needs, precomputed.

    `ranks[k]`: for every node of every shape (concatenated), how many times each sibling rank occurs on its path,
    below the root (the first `width` columns) and below drafted nodes (the next `width`); `owner[k]`: the shape it
    belongs to. The draft cost of a shape is one pass per level with children (the root's
    pass also feeds the last accepted tokens); the root alone drafts nothing.
    """

    shapes: list[list[int]]
    ranks: np.ndarray  # (all nodes, R)
    owner: np.ndarray  # (all nodes,)
    passes: list[list[int]]  # tokens of each draft pass, per shape
    _curves: dict = field(default_factory=dict, compare=False)  # profile -> seconds per shape (`_read_once`)

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]]) -> ShapeMenu:
        unique = {tuple(int(p) for p in s): None for s in [[-1], *shapes]}
        shapes = [list(s) for s in unique]
        for s in shapes:
            validate_parents(s)
        rows, owner, passes = [], [], []
        for index, parents in enumerate(shapes):
            path_ranks, seen = [[]], {}
            for node in range(1, len(parents)):
                rank = seen.get(parents[node], 0)
                seen[parents[node]] = rank + 1
                path_ranks.append(path_ranks[parents[node]] + [rank])
            rows += path_ranks
            owner += [index] * len(parents)
            widths = level_widths_with_children(parents)
            passes.append([ROOT_PASS_TOKENS if level == 0 else w for level, w in enumerate(widths)])
        width = max(max((max(r, default=-1) for r in rows), default=-1) + 1, 1)
        ranks = np.zeros((len(rows), 2 * width))
        for i, path in enumerate(rows):
            np.add.at(ranks[i], [rank + (width if step else 0) for step, rank in enumerate(path)], 1)
        return cls(shapes, ranks, np.array(owner), passes)

    @property
    def width(self) -> int:
        """Most children any node of any shape has (the ranks `RankAcceptance` must learn)."""
        return self.ranks.shape[1] // 2

    def expected_tokens(self, acceptance: np.ndarray) -> np.ndarray:
        """E(shape; p) for every shape: the sum over its nodes of the product of p along the path (root = 1), the
        first step's rates from the row below the root (`by_depth`)."""
        rows = by_depth(acceptance)[:, : self.width]
        logp = np.log(np.clip(rows, 1e-12, None)).reshape(-1)
        return np.bincount(self.owner, weights=np.exp(self.ranks @ logp), minlength=len(self.shapes))

    def seconds_per_step(self, sizer: StepSizer) -> np.ndarray:
        """Predicted seconds of one step with every shape, from the sizer's corrected latency curves (the curves are
        read once per profile; the sizer's corrections scale them)."""
        drafting, target = _read_once(self._curves, sizer.profile, lambda profile: (
            np.array([sum(float(profile.draft(w)) for w in ws) for ws in self.passes]),
            profile.target(np.array([len(s) for s in self.shapes]))))
        return _step_seconds(sizer, drafting, target)

    def seconds_per_token(self, sizer: StepSizer, acceptance: Acceptances, slowest_share: float = 1.0) -> np.ndarray:
        """Predicted seconds per token of every shape (index 0: plain). `acceptance`: one sequence's, or one per row
        of a batch drafting the shape for every row (the sizer's curves are then the batch's, `sizing.for_batch`).
        A batch's step counts as every row adding what its slowest row is expected to: the call lasts as long as
        that row takes, and a row that finishes first leaves a pass that costs about as much without it (a plain
        step over 8 rows cost 1.1-1.4x one over 1 on a 2-core Zen 3). (Traced at 8 rows on that CPU: the slowest
        rows took 17-18 steps for 48 tokens, the others 8-14.) `slowest_share`: what the slowest row adds as a share of
        what its acceptance predicts, for rows whose acceptance is one prior (`call_pricing.SLOWEST_ROW_SHARE`); a step
        adds at least its bonus token."""
        rows = [acceptance] if isinstance(acceptance, RankAcceptance) else list(acceptance)
        slowest = np.min([self.expected_tokens(row.vectors()) for row in rows], axis=0)
        slowest = np.maximum(slowest_share * slowest, 1.0)  # every shape's tokens count the root: 1 at 1.0
        return self.seconds_per_step(sizer) / (len(rows) * slowest)

    def best(self, sizer: StepSizer, acceptance: Acceptances) -> tuple[int, float]:
        """(index of the shape with the least predicted seconds per token, that prediction); index 0 is plain."""
        per_token = self.seconds_per_token(sizer, acceptance)
        best = int(per_token.argmin())
        return best, float(per_token[best])


@dataclass(frozen=True)
class ShapeDepths:
    """One shape's nodes by depth and sibling rank, for predicting it part-drafted: which level to stop after."""

    parents: np.ndarray
    depths: np.ndarray
    ranks: np.ndarray  # each node's rank among its siblings (the root: 0)
    pass_tokens: list[int]  # tokens the pass of level j feeds (the root's: ROOT_PASS_TOKENS)
    levels: list[np.ndarray]  # the nodes of each depth
    _curves: dict = field(default_factory=dict, compare=False, repr=False)  # profile -> seconds per stop (`_read_once`)

    @classmethod
    def of(cls, parents: Sequence[int]) -> ShapeDepths:
        depths, ranks, seen = [0] * len(parents), [0] * len(parents), {}
        for node in range(1, len(parents)):
            depths[node] = depths[parents[node]] + 1
            ranks[node] = seen.get(parents[node], 0)
            seen[parents[node]] = ranks[node] + 1
        widths = level_widths_with_children(list(parents))
        passes = [ROOT_PASS_TOKENS if level == 0 else w for level, w in enumerate(widths)]
        depths = np.array(depths)
        levels = [np.flatnonzero(depths == depth) for depth in range(int(depths.max()) + 1)]
        return cls(np.array(parents), depths, np.array(ranks), passes, levels)

    def best_stop(self, values: Sequence[float], drafted: int, acceptance: np.ndarray, sizer: StepSizer) -> int:
        """How many levels to draft in all (>= `drafted`, the levels whose passes ran): the stop with the least
        predicted time per token. Drafted nodes (depth <= `drafted`) are worth `values` (the chance the target keeps
        their path, from the draft's own probabilities); a node not drafted yet is worth its drafted ancestor's value
        times the learned positional acceptance along the way (`by_depth` rows), as the menu predicts whole shapes.
        Looking past the next level matters: one more pass alone may not pay where the two after it do. Runs before
        every draft pass of a sized step, so what depends on the shape and the curves alone is computed once."""
        predicted = np.asarray(values, dtype=float).copy()
        p = np.pad(by_depth(acceptance), ((0, 0), (0, 1)))
        rates = p[(self.depths > 1).astype(int), np.minimum(self.ranks, p.shape[1] - 1)]
        for level in self.levels[drafted + 1 :]:  # level by level: parents come first
            predicted[level] = predicted[self.parents[level]] * rates[level]
        stops = np.arange(drafted, len(self.pass_tokens) + 1)
        expected = np.cumsum(np.bincount(self.depths, weights=predicted))[stops]  # the root's value is 1
        # per stop s (levels drafted): drafting levels 0 .. s - 1, and the target's pass over the nodes of depth <= s
        drafting, target = _read_once(self._curves, sizer.profile, lambda profile: (
            np.cumsum([0.0, *(float(profile.draft(w)) for w in self.pass_tokens)]),
            profile.target(np.cumsum([len(level) for level in self.levels])[: len(self.pass_tokens) + 1])))
        seconds = _step_seconds(sizer, drafting[stops], target[stops])
        return int(stops[np.argmin(seconds / expected)])


def _read_once(cache: dict, profile, read) -> tuple[np.ndarray, np.ndarray]:
    """`read(profile)`: (drafting, target) seconds from the latency curves, read once per profile and kept in
    `cache` (the profile kept with them, so its id is not reused while cached)."""
    if id(profile) not in cache:
        if len(cache) >= 64:  # a cached menu or shape meets new curves every call (a batch's, per batch size)
            cache.clear()
        drafting, target = read(profile)
        cache[id(profile)] = (profile, np.asarray(drafting, dtype=float), np.asarray(target, dtype=float))
    return cache[id(profile)][1:]


def _step_seconds(sizer: StepSizer, drafting: np.ndarray, target: np.ndarray) -> np.ndarray:
    """A step's predicted seconds: the curves' drafting and target seconds, scaled by the sizer's corrections."""
    return sizer.draft_scale * drafting + sizer.target_scale * target + sizer.profile.step_overhead


#: plain steps the prediction chose before one tree is drafted anyway (doubling while it keeps losing), so that
#: acceptance that returns is seen
PROBE_AFTER, MAX_PROBE_AFTER = 8, 64


class PlainProbes:
    """When a cost model keeps choosing plain steps: after `PROBE_AFTER` plain choices in a row, a tree anyway (a
    probe; the wait doubles while probes keep losing, and resets once a tree is chosen on its own merits). Without
    probes a model that learns only from drafted trees would never see acceptance return."""

    def __init__(self) -> None:
        self.plain_choices = 0  # consecutive steps the prediction chose plain
        self.probe_after = PROBE_AFTER

    def probe(self, plain: bool) -> bool:
        """The prediction chose a plain step (`plain`) or a tree: whether to draft a tree anyway."""
        if not plain:
            self.plain_choices, self.probe_after = 0, PROBE_AFTER
            return False
        self.plain_choices += 1
        if self.plain_choices <= self.probe_after:
            return False
        self.plain_choices, self.probe_after = 0, min(2 * self.probe_after, MAX_PROBE_AFTER)
        return True


#: steps a chooser waits after a size probe before the next one (a tree larger than any this call timed)
SIZE_PROBE_AFTER = 2


class ShapeChooser:
    """Each step's shape index in `menu` (0: plain): the best predicted one, or the best tree when `PlainProbes` asks
    for a probe. Counts the steps it shrank below `full_size` nodes (plain steps not counted).

    A shape larger than every target pass this call has timed (`StepSizer.largest_timed`) is priced by the latency
    curve alone, measured before the call and maybe on a busier or quieter machine; the timed passes bound a smaller
    tree's cost from above. Such a shape is drafted only as a size probe: when it is the best predicted, at most once
    every `SIZE_PROBE_AFTER` steps (the best timed shape in between, once some tree was timed), and counted
    (`size_probes`). Its pass is then timed, and the next steps choose among sizes up to it on what it measured. A
    call's first tree is a probe."""

    def __init__(self, menu: ShapeMenu, full_size: int) -> None:
        self.menu, self.full_size = menu, full_size
        self.sizes = np.array([len(shape) for shape in menu.shapes])
        self.probes = PlainProbes()
        self.shrunk_steps = 0
        self.size_probes = 0  # steps that drafted a tree larger than any target pass timed before them
        self._since_probe = SIZE_PROBE_AFTER  # steps since the last size probe

    def choose(self, sizer: StepSizer, acceptance: Acceptances) -> int:
        per_token = self.menu.seconds_per_token(sizer, acceptance)
        timed = self.sizes <= max(sizer.largest_timed, 1)  # plain (one node) is always priced by the guard's steps
        # between probes, only timed shapes; until some tree is timed (a compiling pass is not), any shape
        allowed = np.where(timed | (self._since_probe >= SIZE_PROBE_AFTER or sizer.largest_timed < 2), per_token,
                           np.inf)
        choice = int(allowed.argmin())
        if self.probes.probe(choice == 0) and len(self.menu.shapes) > 1:  # plain probe: the best allowed tree, anyway
            choice = 1 + int(allowed[1:].argmin())
        probing = not timed[choice]
        self.size_probes += probing
        self._since_probe = 0 if probing else self._since_probe + 1
        return choice

    def shrunk(self, nodes: int) -> bool:
        """Whether a step drafting `nodes` nodes is a shrunk one (counted)."""
        shrunk = 1 < nodes < self.full_size
        self.shrunk_steps += shrunk
        return shrunk


#: the sizes (nodes, root included) of the shapes a captured step drafts when sized every step (decoding/captured.py):
#: one compiled graph each, besides the root alone; each stands for the sizes above the one before it
CAPTURED_SIZES = (4, 8, 16, 32, 64)


def bucketed(menu: ShapeMenu, sizer: StepSizer, acceptance: RankAcceptance,
             sizes: Sequence[int] = CAPTURED_SIZES) -> ShapeMenu:
    """`menu` cut to one shape per bucket of `sizes` (more nodes than the bucket before, at most its own): the one
    predicted fastest per token now. A step compiled whole is one graph per shape, so a call sized from this menu
    holds at most `len(sizes) + 1` graphs (the root alone is always on a menu)."""
    per_token = menu.seconds_per_token(sizer, acceptance)
    lengths = np.array([len(shape) for shape in menu.shapes])
    kept, low = [], 1
    for size in sizes:
        inside = np.flatnonzero((lengths > low) & (lengths <= size))
        if len(inside):
            kept.append(menu.shapes[int(inside[per_token[inside].argmin()])])
        low = size
    return ShapeMenu.of(kept)


def sub_shapes_menu(widths: Sequence[int]) -> ShapeMenu:
    """Every shape `widths_parents(w)` with w no wider than `widths` level by level and no deeper: a fixed shape's
    smaller versions, down to a one-token chain."""
    options = [[]]
    for width in widths:
        options += [option + [w] for option in options if len(option) == len(options[-1]) for w in range(1, width + 1)]
    return ShapeMenu.of([widths_parents(option) for option in options[1:]])


def level_cuts_menu(parents: Sequence[int]) -> ShapeMenu:
    """`parents` cut after each of its levels: a fixed shape's shallower versions (a chain's shorter chains), down to
    one level of drafted children."""
    validate_parents(list(parents))
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return ShapeMenu.of([list(parents[: sum(d <= depth for d in depths)]) for depth in range(1, max(depths) + 1)])
