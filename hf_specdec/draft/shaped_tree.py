"""Draft a tree of a fixed shape with a draft model: one draft pass per level, tree attention inside.

The shared drafter of `chain`, `tree` and `sequoia` (whose configs derive from `StaticShapeConfig`, in
`methods/static_shape.py`): they differ only in where the shape comes from.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.drafter import Drafter
from ..core.tree import HostTree, TokenTree
from ..core.verdict import Verdict
from ..logits.child_selection import select_children
from ..logits.processing import draft_top_scores, process_tree_scores
from .draft_model import DraftModelCounts, DraftModelRunner, HostSequence, emitted_tokens, forwarded_prefix


@dataclass(frozen=True)
class ShapeLevel:
    """One level of the shape whose nodes have children, with everything a draft pass over it needs, known before
    drafting (so a step reads nothing back from the device until the tree is done)."""

    parents: torch.Tensor  # shape nodes of this level with children, on the draft's device
    parent_list: list[int]
    widths: list[int]  # children each wants
    children: torch.Tensor  # their children, parent by parent: child j of parent i takes kids[rows[...], cols[...]]
    rows: torch.Tensor
    cols: torch.Tensor
    depths: torch.Tensor  # of the parents (host: a pass's positions and masks are built there)
    sees: torch.Tensor  # (parents, forwarded before + parents) host: each parent's forwarded ancestors


@functools.lru_cache(maxsize=256)
def planned_shape(shape: tuple[int, ...], device: torch.device
                  ) -> tuple[HostTree, TokenTree, list[ShapeLevel], list[int]]:
    """A shape's host tree, its tree on `device` (tokens zero), the levels to expand and the draft-cache slot each
    node takes when forwarded (-1: never; the root is committed, every other node with children is forwarded in the
    pass of its level). Built once per shape and device and shared read-only by every call's drafters: a sized
    drafter meets a few shapes in every call."""
    host = HostTree(parents=list(shape))
    depths_host, ancestors_host = host.structure()
    tree = TokenTree(tokens=torch.zeros(len(shape), dtype=torch.long, device=device),
                     parents=torch.tensor(shape, dtype=torch.long).to(device), _depths=depths_host.to(device),
                     _ancestors=ancestors_host.to(device), _host=host)
    children, depths = host.children(), host.depths()
    slot_of, forwarded, levels = [-1] * len(shape), [], []
    for depth in range(max(depths) + 1):
        parents = [node for node, d in enumerate(depths) if d == depth and children[node]]
        if not parents:
            break
        sees = torch.cat([ancestors_host[parents][:, forwarded],
                          torch.zeros(len(parents), len(parents), dtype=torch.bool)], dim=1)
        if depth > 0:
            for node in parents:
                slot_of[node] = len(forwarded)
                forwarded.append(node)
        rows = [row for row, node in enumerate(parents) for _ in children[node]]
        cols = [col for node in parents for col in range(len(children[node]))]
        levels.append(ShapeLevel(
            parents=torch.tensor(parents, device=device), parent_list=parents,
            widths=[len(children[node]) for node in parents],
            children=torch.tensor([c for node in parents for c in children[node]], device=device),
            rows=torch.tensor(rows, device=device), cols=torch.tensor(cols, device=device),
            depths=torch.full((len(parents),), depth), sees=sees))
    return host, tree, levels, slot_of


class ModelTreeDrafter(DraftModelCounts, Drafter):
    """Grows `shape` (a parents list, BFS order) level by level with `draft_model`: one draft pass per level.

    The draft keeps its own KV cache across steps (see `DraftModelRunner`): after verification `accept` keeps
    only the accepted path, so the draft never re-reads a token. `vocab`: the target's output rows (see
    `DraftModelRunner`), so a draft padded differently never proposes a token the target lacks. Logits, processors,
    child selection and the tree's tensors stay on the draft's device; nothing is read while drafting (the tokens
    reach the host with the verdict's read; a subclass that decides with them reads them once, `_read_tokens`).
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        shape: list[int],
        logits_processor: LogitsProcessorList | None = None,
        child_selection: str = "top_k",
        generator: torch.Generator | None = None,
        vocab: int | None = None,
    ) -> None:
        self.runner = DraftModelRunner(draft_model, vocab)
        self.logits_processor = logits_processor
        self.child_selection = child_selection
        self.generator = generator
        self.sequence = HostSequence()
        self.use_shape(shape)
        self._score_rows: dict[int, torch.Tensor | tuple] = {}  # shape node -> draft scores, or (values, columns)
        self._kept = list(range(len(shape)))  # shape node of each node of the last proposed tree
        self._levels_run = 0
        self._probs: torch.Tensor | None = None  # see _draft_probs
        self._support: torch.Tensor | None = None  # the columns last written into each row of _probs (sparse rows)
        self._width = 0  # the vocabulary-wide width of the rows kept as top-k columns in _score_rows

    def use_shape(self, shape: list[int]) -> None:
        """Draft `shape` from the next step on (what a drafter sized every step switches between)."""
        self._shape_key = tuple(shape)  # names its levels' passes (`forward_tree`'s level)
        self.host_shape, self.shape, self.levels, self.slot_of = planned_shape(self._shape_key, self.runner.device)

    @property
    def num_drafting_tokens(self) -> int:
        return max(self.host_shape.depths())

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        shape, n, device = self.shape, len(self.shape), self.runner.device
        ids = self.sequence.read(input_ids)
        tokens = torch.full((n,), ids[-1], dtype=torch.long, device=device)
        self._kept = list(range(n))
        self._score_rows = {}
        self._levels_run = 0  # levels forwarded this step: the draft cache holds nodes of depth 1 .. this - 1
        if n == 1:  # a root-only plan (the draft never helps): no draft pass at all
            return TokenTree(tokens=tokens, parents=shape.parents, _host=HostTree(self.host_shape.parents, ids[-1:]))
        tokens[1:] = -1
        root_logits = self.runner.sync(ids)
        prefix = input_ids[:, :-1].to(device)
        sampling = self.child_selection != "top_k"
        draft_probs = None
        self._step_started(tokens)
        index, grown = 0, False
        while index < len(self.levels):
            level = self.levels[index]
            if index > 0 and not grown and not self._level_pays(index):
                break  # deeper nodes stay undrafted (-1) and are pruned
            self._levels_run = index + 1
            parent_tokens = tokens[level.parents]
            if level.parent_list[0] != 0:  # forward this level's nodes (the root's logits came with the sync)
                _, logits = self.runner.forward_tree(parent_tokens.clamp(min=0), level.depths, level.sees,
                                                     level=(self._shape_key, index))
            else:
                logits = root_logits[None]
            so_far = TokenTree(tokens=tokens.clamp(min=0), parents=shape.parents, _depths=shape.depths,
                               _ancestors=shape.ancestors, _host=self.host_shape) if self.logits_processor else shape
            top = draft_top_scores(self.logits_processor, prefix, so_far, logits, level.parent_list)
            if top is not None:  # after a -inf top-k: the rows' k columns only, never a vocabulary-wide row again
                scores, columns = top
                self._width = logits.shape[-1]  # the rows' width, for node_scores
                probs = scores.softmax(-1) if sampling else scores
                if sampling:
                    draft_probs = self._draft_probs(logits.shape[-1])
                    self._write_sparse(level.parents, probs, columns)
                self._score_rows.update(zip(level.parent_list, zip(scores, columns)))
                picked = select_children(probs, level.widths, self.child_selection, self.generator)
                kids = torch.where(picked >= 0, columns.gather(1, picked.clamp(min=0)), -1)
            else:
                scores = process_tree_scores(self.logits_processor, prefix, so_far, logits, level.parent_list,
                                             any_tie_order=True)
                probs = scores.softmax(-1) if sampling else scores
                if sampling:
                    draft_probs = self._draft_probs(scores.shape[-1])
                    draft_probs[level.parents] = probs
                self._score_rows.update(zip(level.parent_list, scores))
                kids = picked = select_children(probs, level.widths, self.child_selection, self.generator)
            if level.parent_list[0] != 0:  # an undrafted node has no children (the root is always drafted)
                kids = torch.where(parent_tokens[:, None] >= 0, kids, -1)
            tokens[level.children] = kids[level.rows, level.cols]
            self._level_drafted(level, kids, _log_probs(scores, picked, kids))
            index += 1
            grown = index == len(self.levels) and self._deepen()  # a level grown below the deepest: it pays
            if grown:
                shape, self._kept = self.shape, list(range(len(self.shape)))
                tokens = torch.cat([tokens, tokens.new_full((len(shape) - len(tokens),), -1)])
                draft_probs = self._draft_probs(draft_probs.shape[1]) if draft_probs is not None else None
        return self._prune(tokens, draft_probs)

    # --- hooks for a drafter sized every step (`SizedShapeDrafter`); no host reads here ----------------------
    def _step_started(self, tokens: torch.Tensor) -> None:
        """A step's drafting begins (`tokens`: the shape's tokens, -1 where not drafted yet)."""

    def _level_pays(self, index: int) -> bool:
        """Whether to run the pass of level `index` (> 0); a static shape always drafts every level."""
        return True

    def _level_drafted(self, level: ShapeLevel, kids: torch.Tensor, logq: Callable[[], torch.Tensor]) -> None:
        """Level `level`'s children were chosen: `kids` `(parents, max width)` (-1: none); `logq()` gives their
        log-probabilities under the draft's processed scores `(parents, max width)` (-inf where -1)."""

    def _deepen(self) -> bool:
        """Every level of the shape was drafted: whether to grow it by a level (`use_shape` with the nodes so far
        first, in their order, and new ones below the deepest), which the step then drafts without asking
        `_level_pays` again; a static shape never grows."""
        return False

    def _draft_probs(self, vocab: int) -> torch.Tensor:
        """The `(n, vocab)` draft distributions of the proposed tree: one buffer, zeroed once, whose rows of nodes
        with children are overwritten every step (the rest stay zero); valid until the next `propose`."""
        if self._probs is None or self._probs.shape[1] != vocab:
            self._probs = torch.zeros(len(self.shape), vocab, device=self.runner.device)
            self._support = None
        elif len(self._probs) < len(self.shape):  # a larger shape, or one grown mid-step: the rows so far are kept
            more = len(self.shape) - len(self._probs)
            self._probs = torch.cat([self._probs, self._probs.new_zeros(more, vocab)])
            if self._support is not None:
                self._support = torch.cat([self._support, self._support.new_zeros(more, self._support.shape[1])])
        return self._probs[: len(self.shape)]  # rows of another shape's parents are stale, but only leaves here

    def _write_sparse(self, rows: torch.Tensor, probs: torch.Tensor, columns: torch.Tensor) -> None:
        """Rows `rows` of the buffer become `probs` at `columns` `(len(rows), k)` and zero elsewhere: the columns a
        row was last given are zeroed, the new ones written (no vocabulary-wide pass)."""
        vocab, width = self._probs.shape[1], columns.shape[1]
        if self._support is None or self._support.shape[1] != width:
            if self._support is not None:
                self._probs.zero_()
            self._support = torch.zeros(len(self._probs), width, dtype=torch.long, device=self._probs.device)
        flat, base = self._probs.view(-1), rows[:, None] * vocab
        flat.index_fill_(0, (base + self._support[rows]).flatten(), 0.0)
        flat.index_copy_(0, (base + columns).flatten(), probs.flatten())
        self._support[rows] = columns

    def _read_tokens(self, tokens: torch.Tensor) -> list[int] | None:
        """The drafted tokens on the host, where the drafter has read them to decide (a drafter sized every step);
        None for a fixed shape: nothing is read while drafting, the verdict's read brings the tokens."""
        return None

    def _prune(self, tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> TokenTree:
        """The drafted tree. Nodes that could not be drafted (fewer candidates than the shape wanted, or levels not
        run) are dropped where the tokens were read; unread, the tree keeps the shape, such a node's token -1 (no
        verifier accepts it): the step reads nothing before its verdict."""
        token_list = self._read_tokens(tokens)
        host = HostTree(parents=self.host_shape.parents, tokens=token_list, _structure=self.host_shape.structure())
        columns = self._support[: len(self.shape)] if draft_probs is not None and self._support is not None else None
        tree = TokenTree(tokens=tokens, parents=self.shape.parents, draft_probs=draft_probs, draft_columns=columns,
                         _depths=self.shape.depths, _ancestors=self.shape.ancestors, _host=host)
        if token_list is None:
            return tree
        keep = [node for node, token in enumerate(token_list) if token >= 0]
        if len(keep) == len(token_list):
            return tree
        self._kept = keep
        return tree.select(keep)

    def node_scores(self, nodes: list[int]) -> torch.Tensor | None:
        rows = [self._score_rows.get(self._kept[i]) for i in nodes]
        if any(row is None for row in rows):
            return None
        return torch.stack([row if isinstance(row, torch.Tensor) else _dense(*row, self._width) for row in rows])

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes the draft already forwarded."""
        self.sequence.extend(input_ids, emitted_tokens(tree, verdict))
        depths = self.host_shape.depths()
        slots = [self.slot_of[k] if depths[k] < self._levels_run else -1
                 for k in (self._kept[node] for node in verdict.path[1:])]
        self.runner.commit(self.sequence.read(input_ids), forwarded_prefix(slots))


def read_with_tokens(value: torch.Tensor, tokens: torch.Tensor) -> tuple[float, list[int]]:
    """A one-element `value` (a flag or a probability) and the drafted `tokens` (flattened) in one host read: a
    drafter deciding whether to draft deeper gets, should it stop, the tokens it would otherwise read in a second
    transfer. Read as float32, which holds every token id below 2**24 exactly."""
    read = torch.cat([value.reshape(1).float(), tokens.flatten().float()]).tolist()
    return read[0], [int(token) for token in read[1:]]


def _log_probs(scores: torch.Tensor, picked: torch.Tensor, kids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The log-probabilities of the children `kids` (-1: none), the `picked` columns of `scores`, under the softmax
    of `scores` (-inf where there is no child), computed when asked."""
    def logq() -> torch.Tensor:
        values = scores.float().log_softmax(-1).gather(1, picked.clamp(min=0))
        return torch.where(kids >= 0, values, -math.inf)
    return logq


def _dense(values: torch.Tensor, columns: torch.Tensor, vocab: int) -> torch.Tensor:
    """A row of processed scores from its k columns (-inf elsewhere)."""
    return torch.full((vocab,), -math.inf, device=values.device).scatter(0, columns, values)
