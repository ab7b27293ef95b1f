"""The sampling verifiers' walk down a drafted tree, on the target's device.

At each level the walk's node (a `(1,)` device index, never read) picks one of its children or ends with a bonus
token; the levels run in a fixed number with fixed shapes, so nothing is read until the end: one read of (still
descending, end node, bonus token, first flagged level). A level past the end runs on the node the walk ended at and
changes nothing. How a level picks is the verifier's:

- `TargetWalk` (target sampling): a token drawn from the node's processed row, and the first-drafted child carrying
  it (siblings may repeat a token); where none does, the token is the bonus.
- `ResidualWalk` (recursive rejection sampling, SpecInfer; Sequoia/SpecTr without replacement): the node's children
  tried in order against the target's row `p` and the draft's row `q` they were drawn from (`residual_trials`),
  the first accepted followed; where none is, the bonus is drawn from the residual.

Rows come from `NodeScores` narrowed where the processors allow (top-p in linear time, or top-k columns); a narrowed
row that may not be Transformers' raises its level's flag. A flagged level is decided again on Transformers' row,
with fresh draws, and the levels after it too; the levels before it stand. Whether a level is flagged depends on
the draws above it, but not on its own: conditioned on reaching its node, the level is decided on the target's row
either way, so the walk is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.tree import TokenTree
from ..core.verdict import Verdict
from ..logits.processing import NodeScores
from .random_source import Dist, RandomSource


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


def work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class Walk:
    """A walk's tables (each node's children: tokens, nodes, padded to the widest node) and its loop; subclasses say
    how a level picks (`_pick`)."""

    def __init__(self, tree: TokenTree, device: torch.device) -> None:
        self.tree = tree
        host = tree.host()
        children = host.children()
        self.parents, self.children = host.parents, children
        self.width = max(1, *(len(kids) for kids in children))
        # the tables' shapes come from the host's parents; the tokens stay on the device (read with the verdict)
        slots = torch.tensor([kids + [-1] * (self.width - len(kids)) for kids in children]).to(device)
        tokens = tree.tokens.to(device)
        self.child_tokens = torch.where(slots >= 0, tokens[slots.clamp(min=0)], -1)
        self.child_nodes = slots.clamp(min=0)
        self.ranks = torch.arange(self.width, device=device)
        depths = host.depths()
        self.levels = max(depths) + 1
        #: the most children a node of each depth has: the walk at level d stands on a node of depth d (or has ended)
        self.level_widths = [0] * self.levels
        for node, kids in enumerate(children):
            self.level_widths[depths[node]] = max(self.level_widths[depths[node]], len(kids))
        zero = torch.zeros(1, dtype=torch.long, device=device)
        self.start = _At(zero, tree.tokens[:1].to(device), torch.ones(1, dtype=torch.bool, device=device), zero, zero)
        self.dtype = work_dtype(device)

    def run(self, scores: torch.Tensor | NodeScores, source: RandomSource, stop_early: bool) -> Verdict:
        """Every level, then one read (`stop_early` False); or a read after each level, stopping where the walk ends
        (True: on a CPU, where a read waits for nothing and a level past the end costs a row's processing)."""
        states, exact, level = [self.start], set(), 0  # states[d]: before level d; exact: levels on Transformers' path
        while True:
            stop = level + 1 if stop_early else self.levels
            flagged = torch.full((1,), self.levels, device=self.ranks.device)  # the first flagged live level
            for d in range(level, stop):
                after, flag = self._level(scores, source, states[d], d, narrow=d not in exact)
                del states[d + 1 :]
                states.append(after)
                if flag is not None:
                    flagged = torch.where(flag & states[d].alive & (flagged == self.levels), d, flagged)
            last = states[stop]
            host = self.tree.host()
            lacking = [self.tree.tokens.to(flagged.device)] if host.tokens is None else []  # read with the verdict
            alive, end, bonus, first, *tokens = torch.cat([last.alive.long(), last.end, last.bonus, flagged,
                                                           *lacking]).tolist()
            if lacking:
                host.tokens = tokens
            if first < self.levels:  # decide that level again on Transformers' row, and what follows
                exact.add(first)
                level = first
            elif alive and stop < self.levels:
                level = stop
            else:
                return self._verdict(end, bonus, states, scores)

    def descend(self, scores: torch.Tensor, source: RandomSource) -> tuple[torch.Tensor, torch.Tensor]:
        """Every level on `scores`, the `(n, V)` processed rows of all nodes (nothing narrowed, so nothing flagged),
        and nothing read: the node the walk ended at and its bonus token, `(1,)` device tensors, for a step that
        reads them with the rest of its verdict (`decoding/captured.py`). The last level has no children, so every
        walk has ended after it."""
        at = self.start
        for depth in range(self.levels):
            at, _ = self._level(scores, source, at, depth, narrow=False)
        return at.end, at.bonus

    def _level(self, scores: torch.Tensor | NodeScores, source: RandomSource, at: _At, depth: int,
               narrow: bool) -> tuple[_At, torch.Tensor | None]:
        rank, token, row, flag = self._pick(scores, source, at, depth, narrow)
        found = rank < self.width
        child = self.child_nodes.index_select(0, at.node)[0].gather(0, rank.clamp(max=self.width - 1))
        ends = at.alive & ~found
        return _At(node=torch.where(found, child, at.node), walked=torch.cat([at.walked, token]),
                   alive=at.alive & found, end=torch.where(ends, at.node, at.end),
                   bonus=torch.where(ends, token, at.bonus), row=row), flag

    def _pick(self, scores: torch.Tensor | NodeScores, source: RandomSource, at: _At, depth: int,
              narrow: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One level's decision at `at.node`: the rank of the child followed (`self.width`: none), the token the level
        emits (that child's, or the bonus), the target row it used (None: top-k columns, kept nowhere) and its flag
        (None: Transformers' row)."""
        raise NotImplementedError

    def _row(self, scores: torch.Tensor | NodeScores, at: _At, narrow: bool,
             columns: bool = True) -> tuple[torch.Tensor | None, Dist, torch.Tensor | None]:
        """The node's target row (None when given as top-k columns, where `columns` allows), its distribution (a
        `(V,)` tensor or a pair `(probs, columns)`), and its flag."""
        narrowed = narrow and isinstance(scores, NodeScores)
        top = scores.top_at(at.node, at.walked) if narrowed and columns else None
        if top is not None:  # the row's top-k columns (flagged where a tie at the cut may make them not the row)
            values, columns, flag = top
            return None, (values.to(self.dtype).softmax(-1), columns), flag
        if isinstance(scores, NodeScores):
            row, flag = scores.row_at(at.node, at.walked, narrow)
        else:
            row, flag = scores.index_select(0, at.node)[0], None
        return row, row.to(self.dtype).softmax(-1), flag

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


class TargetWalk(Walk):
    """Target sampling: a token drawn from the node's row, and a descent to the first-drafted child carrying it."""

    def _pick(self, scores, source, at, depth, narrow):
        row, dist, flag = self._row(scores, at, narrow)
        token = source.draw(dist)
        hits = self.child_tokens.index_select(0, at.node)[0] == token
        return torch.where(hits, self.ranks, self.width).amin(0, keepdim=True), token, row, flag


def _normalized(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`r / r.sum()`, or `fallback` where r has no mass, decided on r's device (no read)."""
    mass = r.sum()
    return torch.where(mass > 0, r / mass, fallback)


def residual_trials(p: torch.Tensor, q: torch.Tensor, xs: torch.Tensor, without_replacement: bool):
    """The children at columns `xs` tried in order: each one's acceptance probability `(k,)`, and the target's
    residual after rejecting them all, on p's device.

    Accept child x with min(1, p[x] / q[x]); on a rejection p <- norm(max(p - q, 0)), the target conditioned on
    "not this proposal" (p without x where that has no mass: then p == q and rejecting had probability 0, float
    noise); children drawn without replacement also drop x from q, since the next child was drawn from q without x.
    A child q could not have proposed (q[x] = 0: a padded slot points at a column of no mass) carries no
    information: it is never accepted and changes nothing.
    """
    accept = torch.zeros(len(xs), dtype=p.dtype, device=p.device)
    for i in range(len(xs)):
        x = xs[i : i + 1]
        px, qx = p[x], q[x]
        proposable = qx > 0
        accept[i : i + 1] = torch.where(proposable, (px / qx).clamp(max=1.0), 0.0)
        rejected = _normalized((p - q).clamp(min=0), fallback=_normalized(p.index_fill(0, x, 0), p))
        p = torch.where(proposable, rejected, p)
        if without_replacement:
            q = torch.where(proposable, _normalized(q.index_fill(0, x, 0), q), q)
    return accept, p


class ResidualWalk(Walk):
    """Recursive rejection sampling: the node's children (the most a node of its depth has; a missing one is a
    slot that cannot be accepted) tried against the target's row and the draft's, the first accepted followed,
    else the bonus drawn from the residual. On top-k columns (`NodeScores.top_at`, with the tree's `draft_columns`)
    the trials run on the union of the target's k columns and the draft's."""

    def __init__(self, tree: TokenTree, device: torch.device, without_replacement: bool) -> None:
        super().__init__(tree, device)
        if tree.draft_probs is None and any(self.children):
            raise ValueError("Sampling verifiers need `tree.draft_probs` (the draft distribution at each node).")
        self.draft_probs, self.draft_columns = tree.draft_probs, tree.draft_columns
        self.without_replacement = without_replacement

    def _pick(self, scores, source, at, depth, narrow):
        width = self.level_widths[depth]
        tokens = self.child_tokens.index_select(0, at.node)[0, :width]  # -1 in a missing child's slot
        row, dist, flag = self._row(scores, at, narrow, columns=self.draft_columns is not None or not width)
        if not width:  # nothing drafted below this depth: the bonus is the target's own sample
            return torch.full_like(at.node, self.width), source.draw(dist), row, flag
        q_row = self.draft_probs.index_select(0, at.node.to(self.draft_probs.device))[0]
        if isinstance(dist, tuple):
            accept, residual = self._column_trials(dist, q_row, at.node, tokens)
        else:
            size = max(len(dist), len(q_row)) + 1  # vocabularies may be padded differently; + a column of no mass
            p = torch.nn.functional.pad(dist, (0, size - len(dist)))
            q = torch.nn.functional.pad(q_row.to(p.device, self.dtype), (0, size - len(q_row)))
            q = _normalized(q, fallback=q)  # an all-zero row proposes nothing: every child is skipped
            columns = torch.where(tokens >= 0, tokens, size - 1)
            accept, residual = residual_trials(p, q, columns, self.without_replacement)
        rank, drawn = source.decide(accept, residual)
        followed = rank < width
        token = torch.where(followed, tokens.gather(0, rank.clamp(max=width - 1)), drawn)
        return torch.where(followed, rank, self.width), token, row, flag

    def _column_trials(self, dist: tuple[torch.Tensor, torch.Tensor], q_row: torch.Tensor, node: torch.Tensor,
                       tokens: torch.Tensor) -> tuple[torch.Tensor, Dist]:
        """The trials on the columns the target's top-k row and the draft's row can have mass on: the target's k, the
        draft's (`draft_columns`, those the target's part has counted once there), and one slot of no mass for a child
        in neither (and for a missing child)."""
        p_top, p_cols = dist
        q_cols = self.draft_columns.index_select(0, node.to(self.draft_columns.device))[0].to(p_cols.device)
        cols = torch.cat([p_cols, q_cols, p_cols[:1]])
        twice = (q_cols[:, None] == p_cols[None, :]).any(1)
        valid = torch.cat([torch.ones_like(p_cols, dtype=torch.bool), ~twice, twice[:0].new_zeros(1)])
        inside = valid & (cols < len(q_row))  # draft and target vocabularies may be padded differently
        q = q_row.gather(0, cols.clamp(max=len(q_row) - 1).to(q_row.device)).to(p_cols.device, self.dtype)
        q = torch.where(inside, q, 0.0)
        q = _normalized(q, fallback=q)
        p = torch.cat([p_top, p_top.new_zeros(len(q_cols) + 1)])
        match = (cols[None, :] == tokens[:, None]) & valid[None, :]
        at = torch.where(match.any(1), match.long().argmax(1), len(cols) - 1)
        accept, residual = residual_trials(p, q, at, self.without_replacement)
        return accept, (residual, cols)
