"""Exact sampling verifiers: what they emit is distributed exactly as sampling from the target alone.

Each walks down from the root, touching only the nodes it visits. At a node the target distribution is
`p = softmax(target_scores[node])` (scores already processed: temperature, top-k, top-p...), and for the
residual verifiers the draft distribution its children were drawn from is `q = tree.draft_probs[node]`.
Random draws go through a small `RandomSource` so tests can enumerate every branch of the real code;
the default one uses a `torch.Generator` (or the global RNG), so seeded runs reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ..core.tree import TokenTree
from ..core.verdict import Verifier
from ..logits.processing import NodeScores
from .registry import register_verifier
from .tree_walk import Verdict, reads_per_level, walk_down

Dist = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a distribution: see RandomSource


class RandomSource(Protocol):
    """The random decisions a verifier makes, one call per visited node.

    A distribution is a `(V,)` tensor of probabilities by token, or a pair `(probs, columns)`, both `(k,)`: mass
    `probs[j]` on token `columns[j]` (a repeated column's masses add), for rows that have mass on a few columns only
    (after a top-k: `NodeScores.top_rows`)."""

    def decide(self, accept: torch.Tensor | None, dists: list[Dist]) -> tuple[int | None, Sequence[int]]:
        """Trials `i = 0..k-1`, each succeeding with probability `accept[i]` `(k,)`: the first that succeeds (None:
        none does, or no trials); and a token drawn from each normalized distribution in `dists` `(V,)`, of which
        the verifier uses at most one. Everything is drawn independently, so the unused draws change nothing.

        A source may also take `doubt=`, a 0-d bool tensor read with the outcome: when true it returns None (the
        rows the distributions came from were not the target's; the verifier corrects them and asks again)."""
        ...

    def draw(self, dist: Dist) -> torch.Tensor:
        """A token drawn from the normalized distribution `dist`, as a `(1,)` long tensor on its device that
        nothing has read: a walk on the device draws level after level and reads once at the end."""
        ...


class TorchRandom:
    """`RandomSource` on a `torch.Generator` (None: torch's global RNG), drawing on the generator's device and
    reading every outcome of a node in one transfer."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def decide(self, accept: torch.Tensor | None, dists: list[Dist],
               doubt: torch.Tensor | None = None) -> tuple[int | None, list[int]] | None:
        device = accept.device if accept is not None else _probs(dists[0]).device
        where = self.generator.device if self.generator is not None else device  # no generator: that device's RNG
        drawn = [self.draw(d) for d in dists]
        flag = torch.zeros(1, dtype=torch.long, device=device) if doubt is None else doubt.reshape(1).to(device).long()
        if accept is None:
            *tokens, doubted = torch.cat([*drawn, flag]).tolist()
            return None if doubted else (None, tokens)
        k = len(accept)
        uniforms = torch.rand(k, dtype=accept.dtype, generator=self.generator, device=where).to(device)
        first = torch.where(uniforms < accept, torch.arange(k, device=device), k).amin(0, keepdim=True)
        rank, *tokens, doubted = torch.cat([first, *drawn, flag]).tolist()
        return None if doubted else ((rank if rank < k else None), tokens)

    def draw(self, dist: Dist) -> torch.Tensor:
        """Inverse transform sampling, as `torch.multinomial` does it (the first column whose cumulative mass passes a
        uniform draw), without its 3-4 ms per 150k-wide row on a CPU; columns of no mass are never drawn. A pair
        `(probs, columns)` is drawn over its k entries, then mapped to its column."""
        probs = _probs(dist)
        where = self.generator.device if self.generator is not None else probs.device
        cdf = probs.to(where).cumsum(0)
        total = cdf[-1:]
        uniform = torch.rand(1, dtype=cdf.dtype, generator=self.generator, device=where)
        index = torch.searchsorted(cdf, uniform * total, right=True)
        last = (cdf < total).sum(0, keepdim=True)  # the last column with mass, should `uniform * total` round up
        index = torch.minimum(index, last).to(probs.device)
        return index if isinstance(dist, torch.Tensor) else dist[1].index_select(0, index.to(dist[1].device))


def _probs(dist: Dist) -> torch.Tensor:
    return dist if isinstance(dist, torch.Tensor) else dist[0]


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _normalized(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`r / r.sum()`, or `fallback` where r has no mass, decided on r's device (no read)."""
    mass = r.sum()
    return torch.where(mass > 0, r / mass, fallback)


def _without(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.index_fill(0, x, 0)


def _decide(source: RandomSource, target_scores: torch.Tensor | NodeScores, nodes: list[int],
            trials: Callable[[torch.Tensor], tuple[torch.Tensor | None, list[torch.Tensor]]],
            top_trials: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, list[torch.Tensor]]]
            | None = None):
    """`source.decide(*trials(rows))`, `rows` the target's processed scores at `nodes` `(len(nodes), V)`: a visited
    node and its children that are leaves, whose bonus tokens are drawn with the node's own decision (one read per
    visited node with children, none for the leaf the walk ends on).

    From `NodeScores` the rows are tentative (top-p in linear time) and the flag saying one may not be Transformers'
    row is read with the outcome: then the outcome is dropped, the rows recomputed on Transformers' path and the node
    decided afresh. The flag depends on the rows only, never on the draws, so the outcome kept is distributed as a
    decision on Transformers' rows.

    `top_trials(values, columns)`: the same decision on the rows' top-k columns (`NodeScores.top_rows`, where the
    processors end with a top-k), tried first; its flag (a tie at the top-k cut) is read with the outcome in the same
    way, and a flagged outcome is dropped for a decision on Transformers' rows.
    """
    if top_trials is not None and isinstance(target_scores, NodeScores):
        top = target_scores.top_rows(nodes)
        if top is not None:
            values, columns, doubt = top
            outcome = source.decide(*top_trials(values, columns), doubt=doubt)
            if outcome is not None:
                return outcome
    while True:
        if isinstance(target_scores, NodeScores):
            rows, doubt = target_scores.tentative(nodes)
        else:
            rows, doubt = target_scores[nodes], None
        accept, dists = trials(rows)
        if doubt is None:
            return source.decide(accept, dists)
        outcome = source.decide(accept, dists, doubt=doubt)
        target_scores.settle(nodes, doubted=outcome is None)
        if outcome is not None:
            return outcome


def _target_dists(rows: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The target's distributions from its processed rows."""
    return list(rows.to(dtype).softmax(-1))


def _trials(p: torch.Tensor, q: torch.Tensor, xs: torch.Tensor, without_replacement: bool):
    """The children `xs` tried in order: each one's acceptance probability `(k,)`, and the target's residual after
    rejecting them all, on p's device.

    Accept child x with min(1, p[x] / q[x]); on a rejection p <- norm(max(p - q, 0)), the target conditioned on
    "not this proposal" (p without x where that has no mass: then p == q and rejecting had probability 0, float
    noise); children drawn without replacement also drop x from q, since the next child was drawn from q without x.
    A child q could not have proposed (q[x] = 0) carries no information: it is never accepted and changes nothing.
    """
    accept = torch.zeros(len(xs), dtype=p.dtype, device=p.device)
    for i in range(len(xs)):
        x = xs[i : i + 1]
        px, qx = p[x], q[x]
        proposable = qx > 0
        accept[i : i + 1] = torch.where(proposable, (px / qx).clamp(max=1.0), 0.0)
        rejected = _normalized((p - q).clamp(min=0), fallback=_normalized(_without(p, x), p))
        p = torch.where(proposable, rejected, p)
        if without_replacement:
            q = torch.where(proposable, _normalized(_without(q, x), q), q)
    return accept, p


def _residual_verify(
    tree: TokenTree, target_scores: torch.Tensor, source: RandomSource, without_replacement: bool
) -> Verdict:
    """Recursive rejection sampling (SpecInfer; Sequoia/SpecTr when `without_replacement`).

    At each visited node the children's trials (`_trials`) run on the target's device and the source reads the
    outcome once: the first accepted child, where the walk descends, or a token from the residual. Nothing
    drafted below a node: sample from p.
    """
    tokens = tree.host(tokens=True).tokens
    dtype = _work_dtype(target_scores.device)
    children_of = tree.host().children()

    def choose(node: int, children: list[int]):
        if children and tree.draft_probs is None:
            raise ValueError("Sampling verifiers need `tree.draft_probs` (the draft distribution at each node).")
        leaves = [child for child in children if not children_of[child]]
        xs = torch.tensor([tokens[child] for child in children]).to(target_scores.device)

        def trials(rows: torch.Tensor):
            p = rows[0].to(dtype).softmax(-1)
            if not children:  # a root with nothing drafted below it
                return None, [p]
            q = tree.draft_probs[node].to(device=p.device, dtype=dtype)
            if len(q) != len(p):  # draft and target vocabularies may be padded differently
                size = max(len(p), len(q))
                p, q = (torch.nn.functional.pad(t, (0, size - len(t))) for t in (p, q))
            q = _normalized(q, fallback=q)  # an all-zero row proposes nothing: every child is skipped
            accept, residual = _trials(p, q, xs, without_replacement)
            return accept, [residual, *_target_dists(rows[1:], dtype)]

        def top_trials(values: torch.Tensor, columns: torch.Tensor):
            """`trials` on the columns the target's top-k rows and the draft's row can have mass on: the target's
            k, the draft's (`tree.draft_columns`), and one slot for a child in neither (p = q = 0 there)."""
            p_top, p_cols = values[0].to(dtype).softmax(-1), columns[0]
            leaf_dists = [(values[i].to(dtype).softmax(-1), columns[i]) for i in range(1, len(values))]
            if not children:
                return None, [(p_top, p_cols)]
            q_row, q_cols = tree.draft_probs[node], tree.draft_columns[node].to(p_cols.device)
            cols = torch.cat([p_cols, q_cols, p_cols[:1]])
            twice = (q_cols[:, None] == p_cols[None, :]).any(1)  # counted once, in the target's part
            valid = torch.cat([torch.ones_like(p_cols, dtype=torch.bool), ~twice, twice[:0].new_zeros(1)])
            inside = valid & (cols < len(q_row))  # draft and target vocabularies may be padded differently
            q = q_row.gather(0, cols.clamp(max=len(q_row) - 1).to(q_row.device)).to(p_cols.device, dtype)
            q = torch.where(inside, q, 0.0)
            q = _normalized(q, fallback=q)
            p = torch.cat([p_top, p_top.new_zeros(len(q_cols) + 1)])
            match = (cols[None, :] == xs[:, None]) & valid[None, :]
            at = torch.where(match.any(1), match.long().argmax(1), len(cols) - 1)
            accept, residual = _trials(p, q, at, without_replacement)
            return accept, [(residual, cols), *leaf_dists]

        compact = not children or tree.draft_columns is not None
        rank, drawn = _decide(source, target_scores, [node, *leaves], trials, top_trials if compact else None)
        if rank is None:
            return None, drawn[0]
        child = children[rank]
        return child, (drawn[1 + leaves.index(child)] if child in leaves else None)

    return walk_down(tree, choose)


class _ResidualVerifier(Verifier):
    """Recursive rejection sampling (`_residual_verify`); subclasses say how the drafter drew the children."""

    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)
    without_replacement: ClassVar[bool]

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        return _residual_verify(tree, target_scores, source or TorchRandom(generator),
                                without_replacement=self.without_replacement)


@register_verifier
class SequoiaVerifier(_ResidualVerifier):
    """Exact for children drawn without replacement from q (Sequoia / SpecTr-style recursive rejection)."""

    name: ClassVar[str] = "sequoia"
    child_selection: ClassVar[str] = "without_replacement"
    without_replacement: ClassVar[bool] = True


@register_verifier
class SpecInferVerifier(_ResidualVerifier):
    """Exact for children drawn i.i.d. from q (SpecInfer's multi-step speculative sampling)."""

    name: ClassVar[str] = "specinfer"
    child_selection: ClassVar[str] = "with_replacement"
    without_replacement: ClassVar[bool] = False


@register_verifier
class TargetSampleVerifier(Verifier):
    """Sample from the target at each node and descend while a child carries the sample.

    Exact for any tree whose shape and tokens do not depend on the target's randomness (top-k, best-first,
    n-gram drafts): the emitted tokens are literally target samples; the tree only decides how many per step.
    The walk runs on the target's device (`TargetWalk`): one processed row and one draw per level.
    """

    name: ClassVar[str] = "target_sample"
    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)
    child_selection: ClassVar[str] = "top_k"
    #: Read after every level and stop where the walk ends (True), or run every level and read once (False). None:
    #: the former on CPU, where a read waits for nothing while a level past the walk's end costs a row's processing.
    stop_early: ClassVar[bool | None] = None

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        stop_early = reads_per_level(self.stop_early, target_scores.device)
        return TargetWalk(tree, target_scores.device).run(target_scores, source or TorchRandom(generator), stop_early)


@dataclass
class _At:
    """The walk before a level: its node and the tokens from the root to it, whether it still descends, where and
    with which token it ended (`(1,)` device tensors, never read), and the row the level before it used."""

    node: torch.Tensor
    walked: torch.Tensor
    alive: torch.Tensor
    end: torch.Tensor
    bonus: torch.Tensor
    row: torch.Tensor | None = None


class TargetWalk:
    """Target sampling as a walk on the device: at each level, the current node's row processed (NodeScores.row_at),
    a token drawn from it, and a descent to the child carrying it (the first drafted, where siblings repeat one);
    where none does, the walk ends and the token is the bonus (a leaf has no child: its draw is the bonus).

    Levels past the end run on the node the walk ended at and change nothing, so nothing needs reading until the
    end: one read of (still descending, end, bonus, first level whose narrowed row may not be Transformers'). A
    flagged level is decided again on Transformers' row, with fresh draws, and the levels after it too; the levels
    before it stand. Whether a level is flagged depends on the draws above it, but not on its own: conditioned on
    reaching its node, the level is decided on the target's row either way, so the walk is exact.
    """

    def __init__(self, tree: TokenTree, device: torch.device) -> None:
        host = tree.host(tokens=True)
        children = host.children()
        self.parents, self.children = host.parents, children
        self.width = max(1, *(len(kids) for kids in children))

        def table(rows: list[list[int]], fill: int) -> torch.Tensor:
            return torch.tensor([row + [fill] * (self.width - len(row)) for row in rows]).to(device)

        self.child_tokens = table([[host.tokens[kid] for kid in kids] for kids in children], -1)
        self.child_nodes = table(children, 0)
        self.ranks = torch.arange(self.width, device=device)
        self.levels = max(host.depths()) + 1
        zero = torch.zeros(1, dtype=torch.long, device=device)
        self.start = _At(zero, tree.tokens[:1].to(device), torch.ones(1, dtype=torch.bool, device=device), zero, zero)
        self.dtype = _work_dtype(device)

    def run(self, scores: torch.Tensor | NodeScores, source: RandomSource, stop_early: bool) -> Verdict:
        states, exact, level = [self.start], set(), 0  # states[d]: before level d; exact: levels on Transformers' path
        while True:
            stop = level + 1 if stop_early else self.levels
            flagged = torch.full((1,), self.levels, device=self.ranks.device)  # the first flagged live level
            for d in range(level, stop):
                after, flag = self._level(scores, source, states[d], narrow=d not in exact)
                del states[d + 1 :]
                states.append(after)
                if flag is not None:
                    flagged = torch.where(flag & states[d].alive & (flagged == self.levels), d, flagged)
            last = states[stop]
            alive, end, bonus, first = torch.cat([last.alive.long(), last.end, last.bonus, flagged]).tolist()
            if first < self.levels:  # decide that level again on Transformers' row, and what follows
                exact.add(first)
                level = first
            elif alive and stop < self.levels:
                level = stop
            else:
                return self._verdict(end, bonus, states, scores)

    def _level(self, scores: torch.Tensor | NodeScores, source: RandomSource, at: _At,
               narrow: bool) -> tuple[_At, torch.Tensor | None]:
        top = scores.top_at(at.node, at.walked) if narrow and isinstance(scores, NodeScores) else None
        if top is not None:  # the row's top-k columns (flagged where a tie at the cut may make them not the row)
            values, columns, flag = top
            row = None
            token = source.draw((values.to(self.dtype).softmax(-1), columns))
        else:
            if isinstance(scores, NodeScores):
                row, flag = scores.row_at(at.node, at.walked, narrow)
            else:
                row, flag = scores.index_select(0, at.node)[0], None
            token = source.draw(row.to(self.dtype).softmax(-1))
        hits = self.child_tokens.index_select(0, at.node)[0] == token
        rank = torch.where(hits, self.ranks, self.width).amin(0, keepdim=True)
        found = rank < self.width
        child = self.child_nodes.index_select(0, at.node)[0].gather(0, rank.clamp(max=self.width - 1))
        ends = at.alive & ~found
        return _At(node=torch.where(found, child, at.node), walked=torch.cat([at.walked, token]),
                   alive=at.alive & found, end=torch.where(ends, at.node, at.end),
                   bonus=torch.where(ends, token, at.bonus), row=row), flag

    def _verdict(self, end: int, bonus: int, states: list[_At], scores: torch.Tensor | NodeScores) -> Verdict:
        path = [end]
        while path[-1] != 0:
            path.append(self.parents[path[-1]])
        path.reverse()
        if isinstance(scores, NodeScores):  # the rows the walk used are Transformers' (none flagged): keep them
            for depth, node in enumerate(path):
                if states[depth + 1].row is not None:  # None: the level drew from top-k columns, kept no row
                    scores.keep(node, states[depth + 1].row)
        ranks = [self.children[parent].index(child) for parent, child in zip(path, path[1:])]
        return Verdict(path=path, bonus_token=bonus, accepted_ranks=ranks)
