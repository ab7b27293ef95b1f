"""Draft a tree of a fixed shape with a draft model: one draft pass per level, tree attention inside.

The shared drafter of `chain`, `tree` and `sequoia` (whose configs derive from `StaticShapeConfig`): they differ
only in where the shape comes from.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.config import SpeculationConfig
from ..core.drafter import Drafter
from ..core.model_info import vocab_size
from ..core.processing import process_tree_scores
from ..core.tree import TokenTree
from ..core.verdict import Verdict
from .child_selection import CHILD_SELECTIONS, select_children
from .draft_model import DraftModelCounts, DraftModelRunner, forwarded_prefix


class ModelTreeDrafter(DraftModelCounts, Drafter):
    """Grows `shape` (a parents list, BFS order) level by level with `draft_model`: one draft pass per level.

    The draft keeps its own KV cache across steps (see `DraftModelRunner`): after verification `accept` keeps
    only the accepted path, so the draft never re-reads a token. `vocab`: the target's output rows (see
    `DraftModelRunner`), so a draft padded differently never proposes a token the target lacks.
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
        self.shape = TokenTree.from_parents(torch.zeros(len(shape), dtype=torch.long), shape)
        self.logits_processor = logits_processor
        self.child_selection = child_selection
        self.generator = generator
        self._score_rows: dict[int, torch.Tensor] = {}  # shape node -> processed draft scores (nodes with children)
        self._kept = torch.arange(len(shape))  # shape node of each node of the last proposed tree
        self._levels = [torch.nonzero(self.shape.depths == d).flatten() for d in range(self.shape.max_depth + 1)]
        self._num_children = torch.bincount(self.shape.parents[1:], minlength=len(shape))
        self._children = [self.shape.children(i) for i in range(len(shape))]

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        shape, n = self.shape, len(self.shape)
        tokens = torch.full((n,), -1, dtype=torch.long)
        tokens[0] = int(input_ids[0, -1])
        slots = torch.full((n,), -1, dtype=torch.long)  # draft-cache slot of each forwarded node
        self._slots, self._kept = slots, torch.arange(n)
        self._score_rows = scores_rows = {}
        if n == 1:  # a root-only plan (the draft never helps): no draft pass at all
            return TokenTree(tokens=tokens, parents=shape.parents)
        node_logits = {0: self.runner.sync(input_ids[0])}
        draft_probs = None
        prefix = input_ids[:, :-1].cpu()
        for level in self._levels:
            parents = level[(self._num_children[level] > 0) & (tokens[level] >= 0)]
            if len(parents) == 0:
                break
            if int(parents[0]) != 0:  # forward this level's nodes with tree attention over the cache
                forwarded = torch.nonzero(slots >= 0).flatten()  # in slot order (BFS); the root is committed
                sees = shape.ancestors[parents][:, forwarded]
                sees = torch.cat([sees, torch.zeros(len(parents), len(parents), dtype=torch.bool)], dim=1)
                _, logits = self.runner.forward_tree(tokens[parents], shape.depths[parents], sees)
                slots[parents] = torch.arange(len(forwarded), len(forwarded) + len(parents))
                node_logits.update(zip(parents.tolist(), logits))
            raw = torch.stack([node_logits[int(p)] for p in parents])
            tree_so_far = TokenTree(
                tokens=tokens.clamp(min=0), parents=shape.parents, _depths=shape.depths, _ancestors=shape.ancestors
            )
            scores = process_tree_scores(self.logits_processor, prefix, tree_so_far, raw, parents)
            probs = scores.softmax(-1) if self.child_selection != "top_k" else scores
            if draft_probs is None and self.child_selection != "top_k":
                draft_probs = torch.zeros(n, scores.shape[-1])
            for row, parent in enumerate(parents.tolist()):
                scores_rows[parent] = scores[row]
                if draft_probs is not None:
                    draft_probs[parent] = probs[row]
            kids = select_children(probs, self._num_children[parents].tolist(), self.child_selection, self.generator)
            for row, parent in enumerate(parents.tolist()):
                child_ids = self._children[parent]
                tokens[child_ids] = kids[row, : len(child_ids)]
        return self._prune(tokens, slots, draft_probs)

    def _prune(self, tokens: torch.Tensor, slots: torch.Tensor, draft_probs: torch.Tensor | None) -> TokenTree:
        """Drop nodes that could not be drafted (fewer candidates than the shape wanted)."""
        tree = TokenTree(tokens=tokens.clamp(min=0), parents=self.shape.parents, draft_probs=draft_probs)
        keep = tokens >= 0
        if bool(keep.all()):
            self._slots = slots
            return TokenTree(tokens=tokens, parents=self.shape.parents, draft_probs=draft_probs)
        self._kept = torch.nonzero(keep).flatten()
        self._slots = slots[self._kept]
        return tree.select(self._kept)

    def node_scores(self, nodes: list[int]) -> torch.Tensor | None:
        rows = [self._score_rows.get(int(self._kept[i])) for i in nodes]
        return None if any(row is None for row in rows) else torch.stack(rows)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes the draft already forwarded."""
        self.runner.commit(input_ids[0], forwarded_prefix(self._slots[verdict.path[1:]]))


class StaticShapeConfig(SpeculationConfig):
    """A method whose every step drafts the same tree shape with the assistant model (`ModelTreeDrafter`)."""

    child_selections = CHILD_SELECTIONS
    default_sampling_verifier = "sequoia"

    def shape(self) -> list[int]:
        """The tree to draft, as a parents list (breadth-first, siblings contiguous)."""
        raise NotImplementedError

    def drafts(self) -> bool:
        return len(self.shape()) > 1

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> ModelTreeDrafter:
        return ModelTreeDrafter(assistant_model, self.shape(), logits_processor, child_selection, generator,
                                vocab_size(target))
