"""Best-first tree growth from a draft model: SpecExec's drafter, and the model stage of a staged stack.

Nodes are ranked by cumulative draft log-probability. Each draft pass forwards, in one tree-attention batch, the
`beams` most probable unexpanded nodes and, when a cheaper `lower` stage sits below, that stage's continuation
tree(s) hanging off the best `lower_leaves` of them. Every node that got logits adds its `width` most probable
children, and the `budget` most probable nodes are kept: a child is never more probable than its parent, so the kept
set is always a connected tree. The first pass of a step also brings the draft cache up to date with the newly
accepted tokens (no separate sync pass).

A lower node is *confirmed* when the draft picks its token among the `width` most probable children of its parent
anyway: it then joins the tree with logits computed over the right ancestors, so its own children are chosen without
another pass, and so on down the lower tree (staged speculative decoding: several levels per draft pass). Unconfirmed
lower nodes are forgotten (their cache slots are never seen again and dropped on commit). With no lower stage this
is SpecExec's growth. It stops after `max_passes` passes, when no unexpanded node can still place a child, or when
the best one is less probable than `min_prob`. Bookkeeping is a handful of tensor ops per pass over at most
`budget + (beams + lower nodes) * width` nodes; the largest buffer is that size squared, as a bool ancestor matrix.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections.abc import Hashable

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.drafter import Drafter
from ..core.processing import process_tree_scores
from ..core.tree import TokenTree, breadth_first_order, renumber_parents, reorder
from ..core.verdict import Verdict
from ..planning.sizing import default_beams
from ..planning.step_sizing import OnlineAcceptance, StepSizer
from .draft_model import DraftModelCounts, DraftModelRunner, forwarded_prefix


class GrowingTree:
    """The tree under construction, in creation order (parents first), with what best-first growth needs."""

    def __init__(self, root: int) -> None:
        self.tokens = torch.tensor([root])
        self.parents = torch.tensor([-1])
        self.depths = torch.tensor([0])
        self.logp = torch.tensor([0.0])  # rank of the node: cumulative log-probability (draft's, or calibrated)
        self.logq = torch.tensor([0.0])  # the draft's log-probability of the node's token under its parent
        self.expanded = torch.tensor([False])
        self.slots = torch.tensor([-1])  # draft-cache slot of forwarded nodes, -1 otherwise (the root is committed)
        self.ancestors = torch.ones(1, 1, dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.tokens)

    def as_tree(self) -> TokenTree:
        return TokenTree(tokens=self.tokens, parents=self.parents, _depths=self.depths, _ancestors=self.ancestors)

    def add_children(
        self, rows: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor
    ) -> torch.Tensor:
        """Append `tokens[i, j]` (rank `logp[i, j]`, draft log-probability `logq[i, j]`) under node `rows[i]`;
        returns the new indices `(i, j)`."""
        n, k = len(self), tokens.numel()
        parents = rows.repeat_interleave(tokens.shape[1])
        ancestors = torch.zeros(n + k, n + k, dtype=torch.bool)
        ancestors[:n, :n] = self.ancestors
        ancestors[n:, :n] = self.ancestors[parents]
        ancestors[n:, n:] = torch.eye(k, dtype=torch.bool)
        self.expanded[rows] = True
        self.tokens = torch.cat([self.tokens, tokens.flatten()])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.logp = torch.cat([self.logp, logp.flatten()])
        self.logq = torch.cat([self.logq, logq.flatten()])
        self.expanded = torch.cat([self.expanded, torch.zeros(k, dtype=torch.bool)])
        self.slots = torch.cat([self.slots, torch.full((k,), -1, dtype=torch.long)])
        self.ancestors = ancestors
        return torch.arange(n, n + k).view(tokens.shape)

    def prune(self, budget: int) -> torch.Tensor:
        """Keep the `budget` most probable nodes, renumbered; returns the old -> new index map (-1: dropped)."""
        ranked = torch.argsort(-self.logp, stable=True)[:budget]  # stable: parents before equally probable children
        keep = ranked[torch.isfinite(self.logp[ranked])].sort().values
        index = torch.full((len(self),), -1, dtype=torch.long)
        index[keep] = torch.arange(len(keep))
        self.parents = renumber_parents(self.parents, keep)
        for name in ("tokens", "depths", "logp", "logq", "expanded", "slots"):
            setattr(self, name, getattr(self, name)[keep])
        self.ancestors = self.ancestors[keep][:, keep]
        return index

    def open_nodes(self, budget: int, max_depth: int) -> torch.Tensor:
        """Unexpanded nodes that can still place a child: above max depth, and more probable than the weakest kept
        node when the tree is full."""
        weakest = self.logp.min() if len(self) >= budget else float("-inf")
        return ~self.expanded & (self.depths < max_depth) & (self.logp > weakest)

    def breadth_first(self) -> tuple[TokenTree, torch.Tensor]:
        """The TokenTree (breadth first, siblings contiguous, most probable sibling first) and its node order."""
        order = breadth_first_order(self.parents, self.depths, self.logp)
        return TokenTree(tokens=self.tokens[order], parents=reorder(self.parents, order)), order


_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def learned_acceptance(draft_model: PreTrainedModel, key: Hashable) -> OnlineAcceptance:
    """The acceptance curve learned so far for this draft and `key` (its target and logits processors): calls that
    follow one another keep learning instead of starting from the prior."""
    return _LEARNED.setdefault(draft_model, {}).setdefault(key, OnlineAcceptance())


def processors_key(processors: LogitsProcessorList | None) -> tuple:
    """What of the logits processors changes acceptance: their types and sampling settings."""
    names = ("temperature", "top_k", "top_p", "min_p", "penalty")
    return tuple((type(p).__name__, *(getattr(p, n, None) for n in names)) for p in processors or [])


class BestFirstDrafter(DraftModelCounts, Drafter):
    """Best-first trees from a draft model (SpecExec); several levels per pass when a `lower` stage guesses right.

    `lower` is any drafter (n-gram lookup, an n-gram model, another `BestFirstDrafter` over a smaller model) or
    None; its trees are never verified by the target, so its `accept` is never called. Deterministic: verify with
    greedy or target sampling. `vocab`: the target's output rows (see `DraftModelRunner`).
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        budget: int,
        max_depth: int = 12,
        width: int = 8,
        beams: int | None = None,
        logits_processor: LogitsProcessorList | None = None,
        lower: Drafter | None = None,
        max_passes: int | None = None,
        lower_leaves: int = 1,
        min_prob: float = 0.0,
        sizer: StepSizer | None = None,
        vocab: int | None = None,
    ) -> None:
        self.runner = DraftModelRunner(draft_model, vocab)
        self.sizer = sizer  # None: grow to `budget`; else size every step by its cost model (`budget` is a cap)
        self.budget, self.max_depth, self.width = budget, max_depth, width
        self.beams = beams or default_beams(budget)
        self.logits_processor = logits_processor
        self.lower, self.lower_leaves = lower, lower_leaves
        self.max_passes = max_passes  # None: until nothing can grow
        self.min_logp = math.log(min_prob) if min_prob > 0 else float("-inf")
        self.lower_forwarded = 0  # lower-stage nodes forwarded (stats)
        self.lower_confirmed = 0  # ... of which joined the tree

    def stage_counts(self) -> list[dict[str, float]]:
        """Per model stage, top first: its passes and how many forwarded lower-stage nodes it confirmed."""
        here = {"model": type(self.runner.model).__name__, "passes": self.runner.forward_count,
                "lower_forwarded": self.lower_forwarded, "lower_confirmed": self.lower_confirmed}
        return [here, *(self.lower.stage_counts() if isinstance(self.lower, BestFirstDrafter) else [])]

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        start = time.perf_counter()
        ids = input_ids[0].cpu()
        nodes = GrowingTree(int(ids[-1]))
        self._slot_nodes = torch.empty(0, dtype=torch.long)  # node held by each forwarded slot (-1: none)
        frontier, hangs = torch.empty(0, dtype=torch.long), [0]
        for step in itertools.count():
            ready, lower = self._pass(ids, nodes, frontier, hangs, first=step == 0)
            self._grow(ids, nodes, ready, lower)
            self._prune(nodes, self.budget)
            open_nodes = nodes.open_nodes(self.budget, self.max_depth)
            if not bool(open_nodes.any()) or float(nodes.logp[open_nodes].max()) < self.min_logp:
                break  # nothing can grow, or not likely enough to be worth a draft pass
            if self.max_passes is not None and step + 1 >= self.max_passes:
                break
            pool = torch.nonzero(open_nodes).flatten()
            pool = pool[torch.argsort(-nodes.logp[pool], stable=True)]
            beams = self.beams
            if self.sizer is not None:  # another pass only if the cost model predicts it pays, and over how many
                values = nodes.logp[1:].exp().sort(descending=True).values
                spent = time.perf_counter() - start
                beams = min(beams, self.sizer.next_frontier(values, nodes.logp[pool].exp(), spent))
                if beams == 0:
                    break
            frontier = pool[:beams]
            hangs = frontier[: self.lower_leaves].tolist()
        if self.sizer is not None:  # hand the target the prefix that minimises the predicted time per token
            values = nodes.logp[1:].exp().sort(descending=True).values
            size, _ = self.sizer.best_size(values, time.perf_counter() - start)
            self._prune(nodes, size)
        tree, order = nodes.breadth_first()
        self._slots, self._logq = nodes.slots[order], nodes.logq[order]
        return tree

    def _prune(self, nodes: GrowingTree, size: int) -> None:
        index = nodes.prune(size)
        self._slot_nodes = torch.where(self._slot_nodes >= 0, index[self._slot_nodes.clamp(min=0)], -1)

    def _lower_tree(self, ids: torch.Tensor, nodes: GrowingTree, hang: int) -> TokenTree | None:
        """The lower stage's continuations after the path to `hang`, cut to the nodes whose logits can be used."""
        if self.lower is None:
            return None
        path = torch.nonzero(nodes.ancestors[hang]).flatten()[1:]  # creation order: root side first
        tree = self.lower.propose(torch.cat([ids, nodes.tokens[path]])[None])
        keep = torch.nonzero(tree.depths + nodes.depths[hang] < self.max_depth).flatten()
        return tree if len(keep) == len(tree) else tree.select(keep)

    def _pass(self, ids: torch.Tensor, nodes: GrowingTree, frontier: torch.Tensor, hangs: list[int], first: bool):
        """One draft pass over `frontier` and the lower trees off `hangs` (the first pass also syncs the cache).

        Returns the nodes that now have logits (node -> logits) and, per hanging node, its forwarded lower tree
        as (tree, node index in that tree, logits of the tree's nodes 1.., slot of the tree's node 1).
        """
        f, old = len(frontier), len(self._slot_nodes)
        frontier_sees = nodes.ancestors[frontier][:, self._slot_nodes.clamp(min=0)] & (self._slot_nodes >= 0)
        tokens, depths, rows = [nodes.tokens[frontier]], [nodes.depths[frontier]], [frontier_sees]
        trees, start = [], f
        for hang in hangs:
            tree = self._lower_tree(ids, nodes, hang)
            if tree is None or len(tree) < 2:
                continue
            size = len(tree) - 1
            sees = torch.zeros(size, old + start + size, dtype=torch.bool)
            if hang != 0:  # the root is committed; any other hanging node is in this pass's frontier
                at = int(torch.nonzero(frontier == hang).flatten()[0])
                sees[:, : old + f] = torch.cat([frontier_sees[at], torch.arange(f) == at])
            sees[:, old + start :] = tree.ancestors[1:, 1:]
            tokens.append(tree.tokens[1:])
            depths.append(tree.depths[1:] + nodes.depths[hang])
            rows.append(sees)
            trees.append((hang, tree, start))
            start += size
        k = start
        sees = torch.zeros(k, old + k, dtype=torch.bool)
        at = 0
        for block in rows:
            sees[at : at + len(block), : block.shape[1]] = block
            at += len(block)
        spent = self.runner.forward_time
        root_logits, logits = self.runner.forward_tree(torch.cat(tokens), torch.cat(depths), sees,
                                                       ids if first else None)
        if self.sizer is not None and not first:  # the first pass also feeds the accepted tokens: not comparable
            self.sizer.observe_draft(k, self.runner.forward_time - spent)
        nodes.slots[frontier] = torch.arange(old, old + f)
        self._slot_nodes = torch.cat([self._slot_nodes, frontier, torch.full((k - f,), -1, dtype=torch.long)])
        ready = {0: root_logits} if first else {}
        ready.update(zip(frontier.tolist(), logits[:f]))
        lower = {}
        for hang, tree, offset in trees:
            lower[hang] = (tree, 0, logits[offset : offset + len(tree) - 1], old + offset)
            self.lower_forwarded += len(tree) - 1
        return ready, lower

    def _grow(self, ids: torch.Tensor, nodes: GrowingTree, ready: dict[int, torch.Tensor], lower: dict) -> None:
        """Expand every node that has logits; a child matching a forwarded lower node takes over its logits and slot
        (it is confirmed) and is expanded in the next round, down the lower tree."""
        prefix = ids[None, :-1]
        while ready:
            rows = torch.tensor(list(ready))
            raw = torch.stack(list(ready.values()))
            scores = process_tree_scores(self.logits_processor, prefix, nodes.as_tree(), raw, rows)
            child_logq, child_tokens = scores.log_softmax(-1).topk(self.width, dim=-1)
            # rank by the draft's own probability, or by the calibrated chance the target keeps the node
            child_logp = child_logq if self.sizer is None else self.sizer.acceptance(child_logq)
            child_logp = child_logp + nodes.logp[rows, None]
            new = nodes.add_children(rows, child_tokens, child_logp, child_logq)
            if self.sizer is not None:
                self.sizer.observe_expansion(nodes.logp[rows].exp(), child_logp.exp())
            ready = {}
            for i, parent in enumerate(rows.tolist()):
                if parent not in lower:
                    continue
                tree, at, tree_logits, base = lower[parent]
                kids = {int(tree.tokens[c]): int(c) for c in tree.children(at)}
                for j, token in enumerate(child_tokens[i].tolist()):
                    c = kids.get(token)
                    if c is None or not bool(torch.isfinite(child_logq[i, j])):
                        continue
                    node, slot = int(new[i, j]), base + c - 1
                    nodes.slots[node] = slot
                    self._slot_nodes[slot] = node
                    lower[node] = (tree, c, tree_logits, base)
                    self.lower_confirmed += 1
                    if int(nodes.depths[node]) < self.max_depth:
                        ready[node] = tree_logits[c - 1]

    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        if self.sizer is not None:
            self.sizer.observe_target(tree_size, seconds)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes already forwarded; drop every other slot. With a sizer,
        learn how often the target kept a child against the draft's probability of it."""
        self.runner.commit(input_ids[0], forwarded_prefix(self._slots[verdict.path[1:]]))
        if self.sizer is not None and len(tree) > 1:
            reached = torch.zeros(len(tree), dtype=torch.bool)
            reached[verdict.path] = True
            children = torch.nonzero(reached[tree.parents[1:]]).flatten() + 1
            self.sizer.acceptance.update(self._logq[children], reached[children])


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
