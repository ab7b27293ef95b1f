"""The model stage of a staged drafter stack: a draft model grows a best-first tree and, in the same passes, checks
the continuations a cheaper stage below proposes, so one draft pass can grow the tree by several levels.

Each draft pass forwards, in one tree-attention batch, (i) the `beams` most probable unexpanded nodes and (ii) the
lower stage's continuation tree(s) hanging off the best `lower_leaves` of them. The first pass of a step also brings
the draft cache up to date with the newly accepted tokens (no separate sync pass). A lower node is *confirmed* when
the model stage picks its token among the `width` most probable children of its parent anyway: it then joins the
tree with logits computed over the right ancestors, so its own children are chosen without another pass, and so
on down the lower tree. Unconfirmed lower nodes are forgotten (their cache slots are never seen again and dropped on
commit). Growth is best-first by cumulative draft probability (as SpecExec): confirmed chains are as cheap to grow
as they are likely, and the budget goes to the most probable nodes whichever pass produced them.
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..decoding.cache import keep_positions
from ..tree import TokenTree
from ..verification.base import Verdict
from ..verification.processing import process_tree_scores
from .base import Drafter
from .draft_model import DraftModelCounts, DraftModelRunner, forwarded_prefix


def tree_from_paths(root: int, paths: list[tuple[int, ...]]) -> TokenTree:
    """A TokenTree (breadth-first, siblings contiguous, in first-listed order) from root-less token paths.

    Duplicate paths are merged; a path's prefixes must be listed too (in any order).
    """
    index: dict[tuple[int, ...], int] = {(): 0}
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in paths:
        if path not in index:
            index[path] = -1
            children.setdefault(path[:-1], []).append(path)
    tokens, parents, queue = [int(root)], [-1], [()]
    for path in queue:  # grows while iterated: a breadth-first walk
        for child in children.get(path, []):
            index[child] = len(tokens)
            tokens.append(child[-1])
            parents.append(index[path])
            queue.append(child)
    return TokenTree.from_parents(tokens, parents)


class MergedDrafter(Drafter):
    """Several cheap drafters at one level of a stack: the union of their trees (earlier drafters' nodes first)."""

    def __init__(self, drafters: list[Drafter], max_nodes: int = 32) -> None:
        self.drafters, self.max_nodes = drafters, max_nodes

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        paths: list[tuple[int, ...]] = []
        for drafter in self.drafters:
            tree = drafter.propose(input_ids)
            tokens = tree.tokens.tolist()
            paths += [tuple(tokens[i] for i in tree.path_to(node)[1:]) for node in range(1, len(tree))]
        unique = list(dict.fromkeys(paths))  # keeps every prefix before its extensions, as each tree did
        return tree_from_paths(int(input_ids[0, -1]), unique[: self.max_nodes - 1])


class StageRunner(DraftModelRunner):
    """`DraftModelRunner` plus one pass that can also catch up the committed tokens and see in-pass ancestors."""

    def forward_tree(
        self, tokens: torch.Tensor, depths: torch.Tensor, sees: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One pass over tree nodes; with `ids`, first make the committed part equal `ids` in the same pass.

        `sees` is `(k, num_nodes + k)` bool: each node's forwarded ancestors among the earlier slots *and* among
        this pass's nodes (a node always sees itself). With `ids`, earlier slots are dropped first (num_nodes = 0).
        Returns the logits of `ids[-1]` (None without `ids`) and the nodes' logits `(k, vocab)`.
        """
        fresh = torch.empty(0, dtype=torch.long)
        if ids is not None:
            ids = ids.cpu()
            n = min(len(self.committed), len(ids) - 1)
            common = int((self.committed[:n] == ids[:n]).long().cumprod(0).sum()) if n else 0
            keep_positions(self.cache, common, [])
            self.committed, self.num_nodes, fresh = ids[:common], 0, ids[common:]
        past, old, m, k = len(self.committed), self.num_nodes, len(fresh), len(tokens)
        allowed = torch.zeros(m + k, past + old + m + k, dtype=torch.bool)
        allowed[:, :past] = True
        allowed[:m, past : past + m] = torch.ones(m, m, dtype=torch.bool).tril()  # old == 0 when m > 0
        allowed[m:, past + old : past + old + m] = True
        allowed[m:, past : past + old] = sees[:, :old]
        allowed[m:, past + old + m :] = sees[:, old:] | torch.eye(k, dtype=torch.bool)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        positions = torch.cat([torch.arange(past, past + m), past + m - 1 + depths])
        inputs = torch.cat([fresh, tokens])
        logits = self._forward(inputs, attention_mask=mask[None, None], position_ids=positions[None])
        if ids is not None:
            self.committed = ids.clone()
        self.num_nodes = old + k
        return (logits[m - 1] if m else None), logits[m:]


class _Nodes:
    """The growing tree in creation order (parents first), with what best-first growth and confirmation need."""

    def __init__(self, root: int) -> None:
        self.tokens = torch.tensor([root])
        self.parents = torch.tensor([-1])
        self.depths = torch.tensor([0])
        self.logp = torch.tensor([0.0])  # cumulative draft log-probability of the path to the node
        self.expanded = torch.tensor([False])
        self.slots = torch.tensor([-1])  # draft-cache slot of forwarded nodes, -1 otherwise (the root is committed)
        self.ancestors = torch.ones(1, 1, dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.tokens)

    def as_tree(self) -> TokenTree:
        return TokenTree(tokens=self.tokens, parents=self.parents, _depths=self.depths, _ancestors=self.ancestors)

    def add_children(self, rows: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Append `tokens[i, j]` (cumulative log-prob `logp[i, j]`) under node `rows[i]`; the new indices `(i, j)`."""
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
        self.expanded = torch.cat([self.expanded, torch.zeros(k, dtype=torch.bool)])
        self.slots = torch.cat([self.slots, torch.full((k,), -1, dtype=torch.long)])
        self.ancestors = ancestors
        return torch.arange(n, n + k).view(tokens.shape)

    def keep(self, keep: torch.Tensor) -> torch.Tensor:
        """Keep the nodes `keep` (sorted, closed under parents), renumbered; returns the old -> new index map."""
        index = torch.full((len(self),), -1, dtype=torch.long)
        index[keep] = torch.arange(len(keep))
        parents = self.parents[keep]
        self.parents = torch.where(parents >= 0, index[parents.clamp(min=0)], -1)
        for name in ("tokens", "depths", "logp", "expanded", "slots"):
            setattr(self, name, getattr(self, name)[keep])
        self.ancestors = self.ancestors[keep][:, keep]
        return index


class ModelStageDrafter(DraftModelCounts, Drafter):
    """A draft model growing best-first trees, several levels per pass when the `lower` stage guesses right.

    `lower` is any drafter (n-gram lookup, an n-gram model, another `ModelStageDrafter` over a smaller model, or
    None for plain best-first growth); its trees are never verified by the target, so its `accept` is never called.
    Deterministic: verify with greedy or target sampling.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        lower: Drafter | None = None,
        budget: int = 32,
        max_depth: int = 10,
        width: int = 4,
        beams: int = 4,
        max_passes: int = 3,
        lower_leaves: int = 1,
        logits_processor: LogitsProcessorList | None = None,
        min_prob: float = 0.0,
    ) -> None:
        self.runner = StageRunner(model)
        self.lower = lower
        self.budget, self.max_depth, self.width, self.beams = budget, max_depth, width, beams
        self.max_passes, self.lower_leaves, self.min_logp = max_passes, lower_leaves, math.log(max(min_prob, 1e-30))
        self.logits_processor = logits_processor
        self.lower_forwarded = 0  # lower-stage nodes forwarded (stats)
        self.lower_confirmed = 0  # ... of which joined the tree

    def stage_counts(self) -> list[dict[str, float]]:
        """Per model stage, top first: its passes and how many forwarded lower-stage nodes it confirmed."""
        here = {"model": type(self.runner.model).__name__, "passes": self.runner.forward_count,
                "lower_forwarded": self.lower_forwarded, "lower_confirmed": self.lower_confirmed}
        return [here, *(self.lower.stage_counts() if isinstance(self.lower, ModelStageDrafter) else [])]

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        ids = input_ids[0].cpu()
        nodes = _Nodes(int(ids[-1]))
        self._slot_nodes = torch.empty(0, dtype=torch.long)  # node held by each forwarded slot (-1: none)
        frontier, hangs = torch.empty(0, dtype=torch.long), [0]
        for step in range(self.max_passes):
            ready, lower = self._pass(ids, nodes, frontier, hangs, first=step == 0)
            self._grow(ids, nodes, ready, lower)
            self._prune(nodes)
            weakest = nodes.logp.min() if len(nodes) >= self.budget else float("-inf")
            open_nodes = ~nodes.expanded & (nodes.depths < self.max_depth) & (nodes.logp > weakest)
            if not bool(open_nodes.any()) or float(nodes.logp[open_nodes].max()) < self.min_logp:
                break  # nothing can grow, or not likely enough to be worth a draft pass
            pool = torch.nonzero(open_nodes).flatten()
            frontier = pool[torch.argsort(-nodes.logp[pool], stable=True)[: self.beams]]
            hangs = frontier[: self.lower_leaves].tolist()
        return self._breadth_first(nodes)

    def _lower_tree(self, ids: torch.Tensor, nodes: _Nodes, hang: int) -> TokenTree | None:
        """The lower stage's continuations after the path to `hang`, cut to the nodes whose logits can be used."""
        if self.lower is None:
            return None
        path = torch.nonzero(nodes.ancestors[hang]).flatten()[1:]  # creation order: root side first
        tree = self.lower.propose(torch.cat([ids, nodes.tokens[path]])[None])
        keep = torch.nonzero(tree.depths + nodes.depths[hang] < self.max_depth).flatten()
        return tree if len(keep) == len(tree) else _subtree(tree, keep)

    def _pass(self, ids: torch.Tensor, nodes: _Nodes, frontier: torch.Tensor, hangs: list[int], first: bool):
        """One draft pass over `frontier` and the lower trees off `hangs` (the first pass also syncs the cache).

        Returns the nodes that now have logits (node -> logits) and, per hanging node, its forwarded lower tree
        as (tree, node index in that tree, logits of the tree's nodes 1.., their slots).
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
        root_logits, logits = self.runner.forward_tree(torch.cat(tokens), torch.cat(depths), sees,
                                                       ids if first else None)
        nodes.slots[frontier] = torch.arange(old, old + f)
        self._slot_nodes = torch.cat([self._slot_nodes, frontier, torch.full((k - f,), -1, dtype=torch.long)])
        ready = {0: root_logits} if first else {}
        ready.update(zip(frontier.tolist(), logits[:f]))
        lower = {}
        for hang, tree, offset in trees:
            lower[hang] = (tree, 0, logits[offset : offset + len(tree) - 1], old + offset)
            self.lower_forwarded += len(tree) - 1
        return ready, lower

    def _grow(self, ids: torch.Tensor, nodes: _Nodes, ready: dict[int, torch.Tensor], lower: dict) -> None:
        """Expand every node that has logits; a child matching a forwarded lower node takes over its logits and slot
        (it is confirmed) and is expanded in the next round, down the lower tree."""
        prefix = ids[None, :-1]
        while ready:
            rows = torch.tensor(list(ready))
            raw = torch.stack(list(ready.values()))
            scores = process_tree_scores(self.logits_processor, prefix, nodes.as_tree(), raw, rows)
            child_logp, child_tokens = scores.log_softmax(-1).topk(self.width, dim=-1)
            new = nodes.add_children(rows, child_tokens, child_logp + nodes.logp[rows, None])
            ready = {}
            for i, parent in enumerate(rows.tolist()):
                if parent not in lower:
                    continue
                tree, at, tree_logits, base = lower[parent]
                kids = {int(tree.tokens[c]): int(c) for c in tree.children(at)}
                for j, token in enumerate(child_tokens[i].tolist()):
                    c = kids.get(token)
                    if c is None or not bool(torch.isfinite(child_logp[i, j])):
                        continue
                    node, slot = int(new[i, j]), base + c - 1
                    nodes.slots[node] = slot
                    self._slot_nodes[slot] = node
                    lower[node] = (tree, c, tree_logits, base)
                    self.lower_confirmed += 1
                    if int(nodes.depths[node]) < self.max_depth:
                        ready[node] = tree_logits[c - 1]

    def _prune(self, nodes: _Nodes) -> None:
        """Keep the `budget` most probable nodes (a connected tree: a child is never more probable than its parent)."""
        ranked = torch.argsort(-nodes.logp, stable=True)[: self.budget]  # stable: parents before equal children
        keep = ranked[torch.isfinite(nodes.logp[ranked])].sort().values
        index = nodes.keep(keep)
        self._slot_nodes = torch.where(self._slot_nodes >= 0, index[self._slot_nodes.clamp(min=0)], -1)

    def _breadth_first(self, nodes: _Nodes) -> TokenTree:
        """Reorder breadth-first with siblings contiguous (what TokenTree wants), most probable sibling first."""
        new_index = torch.zeros(len(nodes), dtype=torch.long)
        order = [torch.tensor([0])]
        placed = 1
        for depth in range(1, int(nodes.depths.max()) + 1):
            level = torch.nonzero(nodes.depths == depth).flatten()
            level = level[torch.argsort(-nodes.logp[level], stable=True)]
            level = level[torch.argsort(new_index[nodes.parents[level]], stable=True)]
            new_index[level] = torch.arange(placed, placed + len(level))
            order.append(level)
            placed += len(level)
        order = torch.cat(order)
        self._slots = nodes.slots[order]
        parents = nodes.parents[order]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], -1)
        return TokenTree(tokens=nodes.tokens[order], parents=parents)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes already forwarded; drop every other slot."""
        self.runner.commit(input_ids[0], forwarded_prefix(self._slots[verdict.path[1:]]))


def _subtree(tree: TokenTree, keep: torch.Tensor) -> TokenTree:
    """The nodes `keep` (sorted, closed under parents, root included) of `tree`, renumbered."""
    index = torch.full((len(tree),), -1, dtype=torch.long)
    index[keep] = torch.arange(len(keep))
    parents = tree.parents[keep]
    return TokenTree(tokens=tree.tokens[keep], parents=torch.where(parents >= 0, index[parents.clamp(min=0)], -1))
