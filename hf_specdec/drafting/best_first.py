"""SpecExec's drafter: grow the tree best-first by cumulative draft probability, up to large budgets.

Each draft pass expands the `beams` most probable nodes not yet expanded, adds their `width` most probable
children, and keeps the global top-`budget` nodes. A child is never more probable than its parent, so the
kept set is always a connected tree. Growth stops early when no unexpanded node can still place a child.
Bookkeeping is a handful of tensor ops per pass over at most `budget + beams * width` nodes, so budgets of
thousands stay cheap; the largest buffer is the `(budget + beams * width)²` bool ancestor matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..config import SpeculationConfig, register_speculation
from ..planning.sizing import choose_budget
from ..tree import TokenTree
from ..verification.base import Verdict
from ..verification.processing import process_tree_scores
from .base import Drafter
from .draft_model import DraftModelCounts, DraftModelRunner, forwarded_prefix


@dataclass
class _Nodes:
    """The growing tree, in creation order (parents before children)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logp: torch.Tensor  # cumulative draft log-probability of the path to the node
    expanded: torch.Tensor
    slots: torch.Tensor  # draft-cache slot of forwarded nodes (see DraftModelRunner), -1 otherwise
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


class BestFirstDrafter(DraftModelCounts, Drafter):
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
        self.runner = DraftModelRunner(draft_model)
        self.budget, self.max_depth, self.width = budget, max_depth, width
        self.beams = beams or max(4, budget // 8)
        self.logits_processor = logits_processor

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        ids = input_ids[0].cpu()
        nodes = _Nodes(ids[-1:], torch.tensor([-1]), torch.tensor([0]), torch.tensor([0.0]),
                       torch.tensor([False]), torch.tensor([-1]), torch.ones(1, 1, dtype=torch.bool))
        slot_nodes = torch.empty(0, dtype=torch.long)  # node held by each forwarded draft-cache slot (-1: dropped)
        frontier, logits = torch.tensor([0]), self.runner.sync(ids)[None]
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
            sees = nodes.ancestors[frontier][:, slot_nodes.clamp(min=0)] & (slot_nodes >= 0)
            logits = self.runner.forward_nodes(nodes.tokens[frontier], nodes.depths[frontier], sees)
            nodes.slots[frontier] = torch.arange(len(slot_nodes), len(slot_nodes) + len(frontier))
            slot_nodes = torch.cat([slot_nodes, frontier])
        return self._breadth_first(nodes)

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
        self.runner.commit(input_ids[0], forwarded_prefix(self._slots[verdict.path[1:]]))


@register_speculation
@dataclass
class SpecExecConfig(SpeculationConfig):
    """`speculation="specexec"`: best-first trees of the draft's most probable continuations (SpecExec).

    Without a `budget`, the budget is chosen from this pair's measured latency curves and acceptance vector (the
    plan store shared with `speculation="sequoia"`: stored, re-sized for this hardware, or calibrated at first use):
    a few dozen nodes for a target in memory, hundreds when accelerate offloads it and every pass costs the same.
    """

    method = "specexec"
    budget: int | None = field(
        default=None,
        metadata={"help": "Tree size incl. the root (2 to 4096). Default: chosen from the measured latency curve."},
    )
    max_depth: int = field(default=12, metadata={"help": "Deepest drafted token (levels below the root)."})
    width: int = field(default=8, metadata={"help": "Children considered per expanded node."})
    beams: int | None = field(default=None, metadata={"help": "Nodes expanded per draft pass (default budget/8)."})
    max_budget: int = field(default=2048, metadata={"help": "Largest budget the automatic choice considers."})

    def validate(self) -> None:
        if self.budget is not None and not 2 <= int(self.budget) <= 4096:
            raise ValueError(f"budget must be between 2 and 4096 tokens, got {self.budget!r}.")
        for name in ("max_depth", "width", "max_budget") + (("beams",) if self.beams is not None else ()):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}.")

    def prepare(self, target, assistant_model, generation_config, input_ids) -> SpecExecConfig:
        if self.budget is not None:
            return self
        from ..calibration.resolve import call_temperature, resolve_plan

        plan, source = resolve_plan(None, target, assistant_model, call_temperature(generation_config), input_ids,
                                    max_budget=128, max_depth=self.max_depth + 1)
        budgets = [b for b in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if b <= self.max_budget]
        budget, _ = choose_budget(plan.acceptance, plan.profile, budgets, self.max_depth,
                                  beams_for=lambda b: self.beams or max(4, b // 8))
        resolved = dataclasses.replace(self, budget=budget)
        resolved.plan_source = f"budget {budget} chosen from the latency curves and acceptance of {source}"
        return resolved

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> BestFirstDrafter:
        if self.budget is None:
            raise RuntimeError("SpecExecConfig.make_drafter needs a budget: call prepare() first.")
        return BestFirstDrafter(assistant_model, int(self.budget), self.max_depth, self.width, self.beams,
                                logits_processor)


def step_memory_bound(
    budget: int, beams: int, width: int, vocab: int, past_length: int, num_heads: int, dtype_bytes: int
) -> int:
    """Bytes one SpecExec step needs beyond both models' weights and KV caches (which grow by `budget` positions).

    Draft side: the `(budget + beams*width)^2` bool ancestor matrix and one pass's float32 logits. Target side: the
    additive mask and the attention scores over `past_length + budget` positions, and the tree's logits in the model
    dtype plus their float32 scores. The ancestor matrix is the only quadratic term; at budget 2048 with the
    defaults it is 37 MB, while the logits of a 150k-token vocabulary (2048 x 150k x 6 B = 1.8 GB) dominate.
    """
    nodes = budget + beams * width
    span = past_length + budget
    draft = nodes * nodes + beams * vocab * 4
    target = budget * span * dtype_bytes + num_heads * budget * span * 4 + budget * vocab * (dtype_bytes + 4)
    return draft + target
