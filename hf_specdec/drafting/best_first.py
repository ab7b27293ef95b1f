"""SpecExec's drafter: grow the tree best-first by cumulative draft probability, up to large budgets.

Each draft pass expands the `beams` most probable nodes not yet expanded, adds their `width` most probable
children, and keeps the global top-`budget` nodes. A child is never more probable than its parent, so the
kept set is always a connected tree. Growth stops early when no unexpanded node can still place a child.
Bookkeeping is a handful of tensor ops per pass over at most `budget + beams * width` nodes, so budgets of
thousands stay cheap; the largest buffer is the `(budget + beams * width)²` bool ancestor matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel

from ..config import SpeculationConfig, register_speculation
from ..decoding.cache import keep_positions
from ..tree import TokenTree
from ..verification.base import Verdict
from ..verification.processing import process_tree_scores
from .base import Drafter


@dataclass
class _Nodes:
    """The growing tree, in creation order (parents before children)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logp: torch.Tensor  # cumulative draft log-probability of the path to the node
    expanded: torch.Tensor
    slots: torch.Tensor  # draft-cache position of forwarded nodes, -1 otherwise
    ancestors: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, keep: torch.Tensor) -> _Nodes:
        """Keep the nodes `keep` (sorted indices, closed under taking parents), renumbered."""
        index = torch.full((len(self),), -1, dtype=torch.long)
        index[keep] = torch.arange(len(keep))
        parents = self.parents[keep]
        return _Nodes(self.tokens[keep], torch.where(parents >= 0, index[parents.clamp(min=0)], -1),
                      self.depths[keep], self.logp[keep], self.expanded[keep], self.slots[keep],
                      self.ancestors[keep][:, keep])

    def add_children(self, frontier: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor) -> _Nodes:
        """Append `tokens[i, j]` as children of `frontier[i]`, with cumulative log-probabilities `logp[i, j]`."""
        n, k = len(self), tokens.numel()
        parents = frontier.repeat_interleave(tokens.shape[1])
        ancestors = torch.zeros(n + k, n + k, dtype=torch.bool)
        ancestors[:n, :n] = self.ancestors
        ancestors[n:, :n] = self.ancestors[parents]
        ancestors[torch.arange(n, n + k), torch.arange(n, n + k)] = True
        expanded = self.expanded.clone()
        expanded[frontier] = True
        return _Nodes(torch.cat([self.tokens, tokens.flatten()]), torch.cat([self.parents, parents]),
                      torch.cat([self.depths, self.depths[parents] + 1]), torch.cat([self.logp, logp.flatten()]),
                      torch.cat([expanded, torch.zeros(k, dtype=torch.bool)]),
                      torch.cat([self.slots, torch.full((k,), -1, dtype=torch.long)]), ancestors)

    def as_tree(self) -> TokenTree:
        return TokenTree(tokens=self.tokens, parents=self.parents, _depths=self.depths, _ancestors=self.ancestors)


class BestFirstDrafter(Drafter):
    """Best-first trees from a draft model (SpecExec). Deterministic: verify with greedy or target sampling."""

    def __init__(
        self,
        draft_model: PreTrainedModel,
        budget: int,
        max_depth: int = 12,
        width: int = 8,
        beams: int | None = None,
        logits_processor: LogitsProcessorList | None = None,
    ) -> None:
        self.model = draft_model
        self.budget, self.max_depth, self.width = budget, max_depth, width
        self.beams = beams or max(4, budget // 8)
        self.logits_processor = logits_processor
        self.cache = DynamicCache(config=draft_model.config)
        self.past = 0  # committed tokens in the draft cache; forwarded tree nodes follow them
        self.cached_ids = torch.empty(0, dtype=torch.long)
        self.forward_count = 0

    def _forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.forward_count += 1
        device = self.model.device
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
        out = self.model(input_ids=input_ids.to(device), past_key_values=self.cache, use_cache=True, **kwargs)
        return out.logits[0].float().cpu()

    def _catch_up(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed the committed tokens the draft cache lacks (at least the root); return the root's logits."""
        n = min(self.past, len(ids) - 1)
        common = int((self.cached_ids[:n] == ids[:n]).long().cumprod(0).sum()) if n else 0
        keep_positions(self.cache, common, [])
        logits = self._forward(ids[common:][None])
        self.past, self.cached_ids = len(ids), ids.clone()
        return logits[-1:]

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        ids = input_ids[0].cpu()
        nodes = _Nodes(ids[-1:], torch.tensor([-1]), torch.tensor([0]), torch.tensor([0.0]),
                       torch.tensor([False]), torch.tensor([len(ids) - 1]), torch.ones(1, 1, dtype=torch.bool))
        slot_nodes = torch.empty(0, dtype=torch.long)  # node held by each forwarded draft-cache slot (-1: dropped)
        frontier, logits = torch.tensor([0]), self._catch_up(ids)
        while True:
            scores = process_tree_scores(self.logits_processor, ids[None, :-1], nodes.as_tree(), logits, frontier)
            child_logp, child_tokens = scores.log_softmax(-1).topk(self.width, dim=-1)
            nodes = nodes.add_children(frontier, child_tokens, child_logp + nodes.logp[frontier, None])
            # Global top-budget by probability; a stable sort puts parents before equally probable children.
            ranked = torch.argsort(-nodes.logp, stable=True)[: self.budget]
            ranked = ranked[torch.isfinite(nodes.logp[ranked])]
            keep = ranked.sort().values
            index = torch.full((len(nodes),), -1, dtype=torch.long)
            index[keep] = torch.arange(len(keep))
            slot_nodes = torch.where(slot_nodes >= 0, index[slot_nodes.clamp(min=0)], -1)
            nodes = nodes.select(keep)
            # Only a node more probable than the weakest kept one can still place a child.
            weakest = nodes.logp.min() if len(nodes) >= self.budget else float("-inf")
            open_nodes = ~nodes.expanded & (nodes.depths < self.max_depth) & (nodes.logp > weakest)
            if not bool(open_nodes.any()):
                break
            pool = torch.nonzero(open_nodes).flatten()
            frontier = pool[torch.argsort(-nodes.logp[pool], stable=True)[: self.beams]]
            logits = self._forward_nodes(nodes, frontier, slot_nodes, len(ids))
            slot_nodes = torch.cat([slot_nodes, frontier])
        return self._breadth_first(nodes)

    def _forward_nodes(self, nodes: _Nodes, frontier: torch.Tensor, slot_nodes: torch.Tensor, length: int):
        """One draft pass over `frontier` with tree attention over the committed cache and forwarded nodes."""
        cache_len = self.past + len(slot_nodes)
        allowed = torch.ones(len(frontier), cache_len + len(frontier), dtype=torch.bool)
        seen = nodes.ancestors[frontier][:, slot_nodes.clamp(min=0)] & (slot_nodes >= 0)
        allowed[:, self.past : cache_len] = seen
        allowed[:, cache_len:] = torch.eye(len(frontier), dtype=torch.bool)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        position_ids = (length - 1 + nodes.depths[frontier])[None]
        logits = self._forward(nodes.tokens[frontier][None], attention_mask=mask[None, None], position_ids=position_ids)
        nodes.slots[frontier] = torch.arange(cache_len, cache_len + len(frontier))
        return logits

    def _breadth_first(self, nodes: _Nodes) -> TokenTree:
        """Reorder into breadth-first order (what TokenTree wants), siblings most probable first."""
        order = torch.argsort(-nodes.logp, stable=True)
        order = order[torch.argsort(nodes.depths[order], stable=True)]
        index = torch.empty_like(order)
        index[order] = torch.arange(len(order))
        parents = nodes.parents[order]
        self._slots = nodes.slots[order]
        return TokenTree(tokens=nodes.tokens[order], parents=torch.where(parents >= 0, index[parents.clamp(min=0)], -1))

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes already forwarded; drop every other tree slot."""
        path_slots = self._slots[verdict.path[1:]]
        forwarded = path_slots[: int((path_slots >= 0).long().cumprod(0).sum())]
        keep_positions(self.cache, self.past, forwarded)
        self.past += len(forwarded)
        self.cached_ids = input_ids[0, : self.past].cpu()


def is_offloaded(model: PreTrainedModel) -> bool:
    """True when accelerate keeps some of the model's weights off its compute device (CPU RAM or disk)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    places = {str(place) for place in device_map.values()}
    return "disk" in places or ("cpu" in places and model.device.type != "cpu")


# Budgets chosen from this project's measured latency curves (DESIGN.md §4): in memory on a CPU a 64-node
# pass costs ~2 single-token passes; offloaded, a pass costs the same for 1 or 1024 tokens (weights dominate).
IN_MEMORY_BUDGET = 64
OFFLOADED_BUDGET = 512


@register_speculation
@dataclass
class SpecExecConfig(SpeculationConfig):
    """`speculation="specexec"`: best-first trees of the draft's most probable continuations (SpecExec)."""

    method = "specexec"
    default_sampling_verifier = "target_sample"
    budget: int | None = field(
        default=None,
        metadata={"help": f"Tree size incl. the root. Default: {IN_MEMORY_BUDGET} with the target in memory, "
                  f"{OFFLOADED_BUDGET} when accelerate offloads it."},
    )
    max_depth: int = field(default=12, metadata={"help": "Deepest drafted token (levels below the root)."})
    width: int = field(default=8, metadata={"help": "Children considered per expanded node."})
    beams: int | None = field(default=None, metadata={"help": "Nodes expanded per draft pass (default budget/8)."})

    def validate(self) -> None:
        if self.budget is not None and not 2 <= int(self.budget) <= 4096:
            raise ValueError(f"budget must be between 2 and 4096 tokens, got {self.budget!r}.")
        for name in ("max_depth", "width") + (("beams",) if self.beams is not None else ()):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}.")

    def budget_for(self, target: PreTrainedModel) -> int:
        if self.budget is not None:
            return int(self.budget)
        return OFFLOADED_BUDGET if is_offloaded(target) else IN_MEMORY_BUDGET

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> BestFirstDrafter:
        return BestFirstDrafter(assistant_model, self.budget_for(target), self.max_depth, self.width, self.beams,
                                logits_processor)
