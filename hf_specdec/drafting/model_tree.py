"""Draft a tree of a fixed shape with a draft model: one draft pass per level, tree attention inside."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel

from ..decoding.cache import keep_positions
from ..tree import TokenTree
from ..verification.base import Verdict
from ..verification.processing import process_tree_scores
from .base import Drafter
from .child_selection import select_children


class ModelTreeDrafter(Drafter):
    """Grows `shape` (a parents list, BFS order) level by level with `draft_model`.

    The draft keeps its own KV cache across steps: committed tokens, then the tree nodes it forwarded.
    After verification `accept` keeps only the accepted path, so the draft never re-reads a token.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        shape: list[int],
        logits_processor: LogitsProcessorList | None = None,
        child_selection: str = "top_k",
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = draft_model
        self.shape = TokenTree.from_parents(torch.zeros(len(shape), dtype=torch.long), shape)
        self.logits_processor = logits_processor
        self.child_selection = child_selection
        self.generator = generator
        self.cache = DynamicCache(config=draft_model.config)
        self.cached_tokens = torch.empty(0, dtype=torch.long)  # token id at each cache position, -1 = tree node
        self.forward_count = 0
        self.last_scores: torch.Tensor | None = None
        self._levels = [torch.nonzero(self.shape.depths == d).flatten() for d in range(self.shape.max_depth + 1)]
        self._num_children = torch.bincount(self.shape.parents[1:], minlength=len(shape))
        self._children = [self.shape.children(i) for i in range(len(shape))]

    def _forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.forward_count += 1
        out = self.model(
            input_ids=input_ids.to(self.model.device), past_key_values=self.cache, use_cache=True, **kwargs
        )
        return out.logits[0]

    def _catch_up(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Feed the committed tokens the cache lacks (at least the last one); return the last logits."""
        ids = input_ids[0].cpu()
        n = min(len(self.cached_tokens), len(ids) - 1)
        same = (self.cached_tokens[:n] == ids[:n]).long()
        common = int(same.cumprod(0).sum()) if n else 0
        keep_positions(self.cache, common, [])
        logits = self._forward(input_ids[:, common:])
        self.cached_tokens = ids.clone()
        return logits[-1]

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        shape = self.shape
        n, vocab = len(shape), None
        tokens = torch.full((n,), -1, dtype=torch.long)
        tokens[0] = int(input_ids[0, -1])
        slots = torch.full((n,), -1, dtype=torch.long)  # draft-cache position of each forwarded node
        past = input_ids.shape[1]
        slots[0] = past - 1
        node_logits = {0: self._catch_up(input_ids)}
        scores_rows, draft_probs = {}, None
        for level in self._levels:
            parents = level[(self._num_children[level] > 0) & (tokens[level] >= 0)]
            if len(parents) == 0:
                break
            if int(parents[0]) != 0:  # forward this level's nodes with tree attention over the cache
                logits = self._forward_nodes(shape, tokens, slots, parents, past)
                node_logits.update(zip(parents.tolist(), logits))
            raw = torch.stack([node_logits[int(p)] for p in parents])
            tree_so_far = TokenTree(
                tokens=tokens.clamp(min=0), parents=shape.parents, _depths=shape.depths, _ancestors=shape.ancestors
            )
            scores = process_tree_scores(
                self.logits_processor, input_ids[:, :-1].cpu(), tree_so_far, raw.cpu(), parents
            )
            probs = scores.softmax(-1) if self.child_selection != "top_k" else scores
            vocab = scores.shape[-1]
            if draft_probs is None and self.child_selection != "top_k":
                draft_probs = torch.zeros(n, vocab)
            for row, parent in enumerate(parents.tolist()):
                scores_rows[parent] = scores[row]
                if draft_probs is not None:
                    draft_probs[parent] = probs[row]
            kids = select_children(probs, self._num_children[parents].tolist(), self.child_selection, self.generator)
            for row, parent in enumerate(parents.tolist()):
                child_ids = self._children[parent]
                tokens[child_ids] = kids[row, : len(child_ids)]
        self.last_scores = torch.stack([scores_rows.get(i, torch.zeros(vocab)) for i in range(n)])
        return self._prune(shape, tokens, slots, draft_probs)

    def _forward_nodes(self, shape: TokenTree, tokens, slots, nodes: torch.Tensor, past: int) -> torch.Tensor:
        forwarded = torch.nonzero(slots[1:] >= 0).flatten() + 1
        cache_len = past + len(forwarded)
        allowed = torch.ones(len(nodes), cache_len + len(nodes), dtype=torch.bool)
        allowed[:, past:cache_len] = shape.ancestors[nodes][:, forwarded]
        allowed[:, cache_len:] = torch.eye(len(nodes), dtype=torch.bool)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        position_ids = (past - 1 + shape.depths[nodes])[None]
        logits = self._forward(
            tokens[nodes][None],
            attention_mask=mask[None, None].to(self.model.device),
            position_ids=position_ids.to(self.model.device),
        )
        slots[nodes] = torch.arange(cache_len, cache_len + len(nodes))
        self.cached_tokens = torch.cat([self.cached_tokens, torch.full((len(nodes),), -1)])
        return logits

    def _prune(self, shape: TokenTree, tokens, slots, draft_probs) -> TokenTree:
        """Drop nodes that could not be drafted (fewer candidates than the shape wanted)."""
        keep = tokens >= 0
        self._slots = slots
        if bool(keep.all()):
            return TokenTree(tokens=tokens, parents=shape.parents, draft_probs=draft_probs)
        new_index = torch.cumsum(keep.long(), 0) - 1
        parents = torch.where(shape.parents >= 0, new_index[shape.parents.clamp(min=0)], shape.parents)[keep]
        self._slots = slots[keep]
        probs = draft_probs[keep] if draft_probs is not None else None
        if self.last_scores is not None:
            self.last_scores = self.last_scores[keep]
        return TokenTree(tokens=tokens[keep], parents=parents, draft_probs=probs)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes the draft already forwarded."""
        path_slots = self._slots[verdict.path[1:]]
        forwarded = path_slots[: int((path_slots >= 0).long().cumprod(0).sum())]
        past = len(self.cached_tokens) - int((self.cached_tokens < 0).sum())
        keep_positions(self.cache, past, forwarded)
        self.cached_tokens = input_ids[0, : past + len(forwarded)].cpu()
