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
the best one is less probable than `min_prob`.

Where the work runs: logits, processors, log-softmax and top-k on the draft's device; only the `(rows, width)` top-k
result crosses to the host, once per expansion round. The tree under construction is host bookkeeping (`Node`s that
keep their index for the whole step: pruning marks nodes dropped instead of renumbering, and a node's forwarded
ancestors come from walking its parents, so no ancestor matrix is ever built).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ...core.drafter import Drafter
from ...core.tree import HostTree, TokenTree
from ...core.verdict import Verdict
from ...draft.draft_model import DraftModelCounts, DraftModelRunner, HostSequence, emitted_tokens, forwarded_prefix
from ...logits.processing import draft_top_scores, process_tree_scores
from ...logits.wide_rows import row_topk
from ...plan.sizing import row_share
from ...plan.step_sizing import StepSizer


@dataclass(slots=True)
class Node:
    """One drafted token of the tree under construction."""

    token: int
    parent: int  # index of the parent node (-1: the root)
    depth: int
    log_rank: float  # the rank, a cumulative log-probability: the draft's, or the calibrated chance the target keeps it
    logq: float  # the draft's log-probability of the token under its parent
    slot: int = -1  # draft-cache slot once forwarded (the root is committed: -1)
    expanded: bool = False
    kept: bool = True  # False once pruned


@dataclass
class LowerTree:
    """A lower stage's continuation tree forwarded in a pass below node `hang`."""

    tree: TokenTree
    host: HostTree
    first_slot: int  # draft-cache slot of the tree's node 1


@dataclass
class LowerAt:
    """A node of the growing tree that stands on node `at` of a forwarded lower tree (its children may confirm)."""

    lower: LowerTree
    at: int


@dataclass
class Growth:
    """One step's tree under construction, in creation order (parents first)."""

    nodes: list[Node]
    prefix: torch.Tensor  # the committed sequence but its last token `(1, L - 1)`, on the draft's device
    ids: list[int]  # the committed sequence (host)

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from below the root down to `node`."""
        tokens = []
        while node > 0:
            tokens.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return tokens[::-1]

    def ancestor_slots(self, node: int) -> list[int]:
        """Draft-cache slots of `node`'s forwarded ancestors, itself excluded."""
        slots, node = [], self.nodes[node].parent
        while node > 0:
            slots.append(self.nodes[node].slot)
            node = self.nodes[node].parent
        return slots

    def kept(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.kept]

    def prune(self, budget: int) -> None:
        """Keep the `budget` most probable nodes (finite ones; ties: earlier first, so parents before children)."""
        ranked = sorted(self.kept(), key=lambda i: (-self.nodes[i].log_rank, i))
        for rank, i in enumerate(ranked):
            self.nodes[i].kept = rank < budget and math.isfinite(self.nodes[i].log_rank)

    def open_nodes(self, budget: int, max_depth: int) -> list[int]:
        """Unexpanded nodes that can still place a child, most probable first: above max depth, and more probable
        than the weakest kept node when the tree is full."""
        kept = self.kept()
        weakest = min(self.nodes[i].log_rank for i in kept) if len(kept) >= budget else -math.inf
        found = [i for i in kept if not self.nodes[i].expanded and self.nodes[i].depth < max_depth
                 and self.nodes[i].log_rank > weakest]
        return sorted(found, key=lambda i: (-self.nodes[i].log_rank, i))

    def values(self) -> list[float]:
        """Probabilities (exp log_rank) of the kept non-root nodes, descending: what the cost model sizes with."""
        return sorted((math.exp(self.nodes[i].log_rank) for i in self.kept()[1:]), reverse=True)

    def breadth_first(self) -> list[int]:
        """Kept nodes breadth first, siblings contiguous in their parents' order, most probable sibling first."""
        place, order, level = {0: 0}, [0], [0]
        while level:
            above = set(level)
            children = [i for i in self.kept() if self.nodes[i].parent in above]
            children.sort(key=lambda i: (place[self.nodes[i].parent], -self.nodes[i].log_rank, i))
            for i in children:
                place[i] = len(order)
                order.append(i)
            level = children
        return order


def default_beams(budget: int) -> int:
    """Nodes a best-first drafter expands per draft pass when none is given: an eighth of the budget, at least 4."""
    return max(4, budget // 8)


def _lower_keys(lower: dict[int, LowerAt]) -> list[tuple[int, int]]:
    """(lower tree, node) of every forwarded lower node but the roots, in `lower`'s order: how `picks` orders them."""
    return [(id(place.lower), c) for place in lower.values() for c in range(1, len(place.lower.host.parents))]


class Grower:
    """How one sequence's best-first tree grows, pass after pass, whoever runs the draft's passes (one sequence's
    `BestFirstDrafter`, or a batch's rows in lockstep, `lockstep.LockstepBestFirstDrafter`): which nodes the next
    pass forwards, the children each forwarded node adds once it has logits, the pruning to `budget`, and, with a
    `sizer`, when to stop and which prefix the target verifies. No model, no cache: the passes are the caller's."""

    def __init__(
        self,
        budget: int,
        max_depth: int = 12,
        width: int = 8,
        beams: int | None = None,
        logits_processor: LogitsProcessorList | None = None,
        max_passes: int | None = None,
        min_prob: float = 0.0,
        sizer: StepSizer | None = None,
    ) -> None:
        self.sizer = sizer  # None: grow to `budget`; else size every step by its cost model (`budget` is a cap)
        self.budget, self.max_depth, self.width = budget, max_depth, width
        self.beams = beams or default_beams(budget)
        self.logits_processor = logits_processor
        self.max_passes = max_passes  # None: until nothing can grow
        self.min_log_rank = math.log(min_prob) if min_prob > 0 else float("-inf")

    def frontier(self, growth: Growth, passes: int, seconds: float) -> list[int]:
        """The nodes the next pass forwards, after `passes` passes and `seconds` of drafting this step; [] to stop:
        nothing can grow, the best open node is less likely than `min_prob`, `max_passes` were run, or the cost model
        predicts no pass lowers the time per token."""
        pool = growth.open_nodes(self.budget, self.max_depth)
        if not pool or growth.nodes[pool[0]].log_rank < self.min_log_rank:
            return []
        if self.max_passes is not None and passes >= self.max_passes:
            return []
        beams = self.beams
        if self.sizer is not None:  # another pass only if the cost model predicts it pays, and over how many
            open_values = [math.exp(growth.nodes[i].log_rank) for i in pool]
            beams = min(beams, self.sizer.next_frontier(growth.values(), open_values, seconds))
        return pool[:beams]

    def finish(self, growth: Growth, seconds: float) -> None:
        """The step's drafting took `seconds`: with a sizer, keep the prefix that minimises the predicted time per
        token."""
        if self.sizer is not None:
            size, _ = self.sizer.best_size(growth.values(), seconds)
            growth.prune(size)

    def output(self, growth: Growth, device: torch.device) -> tuple[TokenTree, list[int], list[float]]:
        """The kept nodes as a TokenTree on `device`, breadth first, with each node's draft-cache slot and draft
        log-probability."""
        order = growth.breadth_first()
        place = {node: i for i, node in enumerate(order)}
        nodes = [growth.nodes[i] for i in order]
        parents = [place[n.parent] if n.parent >= 0 else -1 for n in nodes]
        tokens = [n.token for n in nodes]
        tree = TokenTree(tokens=torch.tensor(tokens).to(device), parents=torch.tensor(parents).to(device),
                         _host=HostTree(parents=parents, tokens=tokens))
        return tree, [n.slot for n in nodes], [n.logq for n in nodes]

    def learn(self, tree: TokenTree, verdict: Verdict, logq: list[float]) -> None:
        """With a sizer, learn how often the target kept a child against the draft's probability of it (`logq`: of
        each node of `tree`)."""
        if self.sizer is not None and len(tree) > 1:
            reached = set(verdict.path)
            parents = tree.host().parents
            children = [node for node in range(1, len(tree)) if parents[node] in reached]
            self.sizer.acceptance.update([logq[c] for c in children], [c in reached for c in children])

    def grow(self, growth: Growth, ready: list[int], logits: torch.Tensor, lower: dict[int, LowerAt]) -> None:
        """Expand every node that has logits (`ready`, whose rows `logits` holds, then the forwarded lower nodes'),
        with one read of their picked children (`picks`, then `grow_from`)."""
        self.grow_from(growth, ready, self.picks(growth, ready, logits, lower).tolist(), lower)  # the read

    def grow_from(self, growth: Growth, ready: list[int], picked: list[list[float]], lower: dict[int, LowerAt]
                  ) -> None:
        """Expand every node that has logits with its children `picked` (`picks`' rows, read); a child matching a
        forwarded lower node takes over its logits and slot (it is confirmed) and is expanded in the next round,
        down the lower tree (the children of every forwarded lower node were picked up front with those of the
        pass's nodes). Then the tree is pruned to the budget."""
        rows = list(ready)
        by_node, below = dict(zip(rows, picked)), dict(zip(_lower_keys(lower), picked[len(rows) :]))
        w = self.width
        while rows:
            if self.sizer is not None:
                parents = [math.exp(growth.nodes[p].log_rank) for p in rows]
                self.sizer.observe_expansion(math.fsum(parents), math.fsum(
                    v * math.exp(r) for v, p in zip(parents, rows) for r in by_node[p][w : 2 * w]))
            confirmed = []
            for parent in rows:
                row = by_node[parent]
                confirmed += self._add_children(growth, parent, row[:w], row[w : 2 * w], [int(t) for t in row[2 * w :]],
                                                lower)
            for node in confirmed:  # their rows were picked with the pass's
                by_node[node] = below[id(lower[node].lower), lower[node].at]
            rows = confirmed
        growth.prune(self.budget)

    def picks(self, growth: Growth, ready: list[int], logits: torch.Tensor, lower: dict[int, LowerAt]
              ) -> torch.Tensor:
        """The `width` best children of every node with logits (`ready`) and of every forwarded lower node, one row
        each (the ready nodes', then the lower nodes' in `lower`'s order, as `logits` holds them): the children's
        log-probabilities, their ranks and their tokens, float64 on the draft's device; nothing is read here."""
        parents, tokens = [n.parent for n in growth.nodes], [n.token for n in growth.nodes]
        at: list[int] = list(ready)  # each row's node in the processors' tree (growth nodes, then the lower nodes)
        for hang, place in lower.items():
            host, first = place.lower.host, len(parents)
            for c in range(1, len(host.parents)):
                parents.append(hang if host.parents[c] == 0 else first + host.parents[c] - 1)
                tokens.append(host.tokens[c])
                at.append(first + c - 1)
        tree = None
        if self.logits_processor:
            tree = TokenTree(tokens=torch.tensor(tokens).to(logits.device), parents=torch.tensor(parents).to(
                logits.device), _host=HostTree(parents=parents, tokens=tokens))
        sparse = draft_top_scores(self.logits_processor, growth.prefix, tree, logits, at) if tree is not None else None
        if sparse is not None and sparse[0].shape[1] >= self.width:  # after a top-k: its k columns are the row
            values, columns = sparse
            logq, tokens_at = values.log_softmax(-1)[:, : self.width], columns[:, : self.width]
        else:
            scores = process_tree_scores(self.logits_processor, growth.prefix, tree, logits, at, any_tie_order=True)
            tokens_at = row_topk(scores, self.width)[1]  # the same columns as the log-softmax's (it keeps the order)
            logq = scores.log_softmax(-1).gather(1, tokens_at)
        # rank by the draft's own probability, or by the calibrated chance the target keeps the node
        rank = logq if self.sizer is None else self.sizer.acceptance(logq)
        return torch.cat([logq.double(), rank.double(), tokens_at.double()], dim=1)

    def _add_children(
        self, growth: Growth, parent: int, logq: list[float], rank: list[float], tokens: list[int],
        lower: dict[int, LowerAt],
    ) -> list[int]:
        """Add `parent`'s children (most probable first); returns the confirmed ones that can grow."""
        node = growth.nodes[parent]
        node.expanded = True
        first = len(growth.nodes)
        for token, q, r in zip(tokens, logq, rank):
            growth.nodes.append(Node(token=token, parent=parent, depth=node.depth + 1, log_rank=node.log_rank + r,
                                     logq=q))
        place = lower.get(parent)
        if place is None:
            return []
        host = place.lower.host
        kids = {host.tokens[c]: c for c in host.children()[place.at]}
        confirmed = []
        for j, (token, q) in enumerate(zip(tokens, logq)):
            c = kids.get(token)
            if c is None or not math.isfinite(q):
                continue
            child = growth.nodes[first + j]
            child.slot = place.lower.first_slot + c - 1
            lower[first + j] = LowerAt(place.lower, at=c)
            if child.depth < self.max_depth:
                confirmed.append(first + j)
        return confirmed



class BestFirstDrafter(DraftModelCounts, Drafter):
    """Best-first trees from a draft model (SpecExec); several levels per pass when a `lower` stage guesses right.

    `lower` is any drafter (n-gram lookup, an n-gram model, another `BestFirstDrafter` over a smaller model) or
    None; its trees are never verified by the target, so its `accept` is never called. Deterministic: verify with
    greedy or target sampling. `vocab`: the target's output rows (see `DraftModelRunner`). How the tree grows is
    the `grower`'s (`Grower`); this runs its passes on the draft's own cache.
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
        self.grower = Grower(budget, max_depth, width, beams, logits_processor, max_passes, min_prob, sizer)
        self._single_profile = None  # the sizer's latency profile for one sequence, once a batch shares it
        self.lower, self.lower_leaves = lower, lower_leaves
        self.sequence = HostSequence()
        self._slots: list[int] = []  # draft-cache slot of each node of the last proposed tree (-1: not forwarded)
        self._logq: list[float] = []  # the draft's log-probability of each node of the last proposed tree

    @property
    def sizer(self) -> StepSizer | None:
        return self.grower.sizer

    def use_window(self, tokens: int | None) -> None:
        """The draft, and every model stage below it, reads only the prompt's last `tokens` tokens (None: all)."""
        self.runner.use_window(tokens)
        if self.lower is not None:
            self.lower.use_window(tokens)

    def share_rows(self, rows: int) -> None:
        """Price each tree as one row's share of the batch's pass (`plan.sizing.row_share`), from the profile the
        sizer had for one sequence."""
        if self.sizer is None:
            return
        if self._single_profile is None:
            self._single_profile = self.sizer.profile
        self.sizer.profile = row_share(self._single_profile, rows)

    @property
    def num_drafting_tokens(self) -> int:
        return self.grower.max_depth

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        start = time.perf_counter()
        ids = self.sequence.read(input_ids)
        growth = Growth(nodes=[Node(token=ids[-1], parent=-1, depth=0, log_rank=0.0, logq=0.0)],
                        prefix=input_ids[:, :-1].to(self.runner.device), ids=ids)
        frontier, hangs, passes = [], [0], 0
        while True:
            ready, logits, lower = self._pass(growth, frontier, hangs, first=passes == 0)
            passes += 1
            self.grower.grow(growth, ready, logits, lower)
            frontier = self.grower.frontier(growth, passes, time.perf_counter() - start)
            if not frontier:
                break
            hangs = frontier[: self.lower_leaves]
        self.grower.finish(growth, time.perf_counter() - start)  # the prefix the target verifies
        tree, self._slots, self._logq = self.grower.output(growth, self.runner.device)
        return tree

    def _lower_tree(self, growth: Growth, hang: int) -> TokenTree | None:
        """The lower stage's continuations after the path to `hang`, cut to the nodes whose logits can be used."""
        if self.lower is None:
            return None
        tree = self.lower.propose_ids(growth.ids + growth.path_tokens(hang))
        room = self.grower.max_depth - growth.nodes[hang].depth
        depths = tree.host().depths()
        keep = [node for node, depth in enumerate(depths) if depth < room]
        return tree if len(keep) == len(tree) else tree.select(keep)

    def _pass(self, growth: Growth, frontier: list[int], hangs: list[int], first: bool):
        """One draft pass over `frontier` and the lower trees off `hangs` (the first pass also syncs the cache).

        Returns the nodes that now have logits, the pass's logits (one row per such node, then one per forwarded
        lower node, tree by tree: the rows `_pick` reads, as the pass returned them, uncopied) and, per hanging node,
        where it stands in its forwarded lower tree.
        """
        old = 0 if first else self.runner.num_nodes  # the first pass drops earlier node slots
        sees_rows = [growth.ancestor_slots(node) for node in frontier]
        tokens = [growth.nodes[node].token for node in frontier]
        depths = [growth.nodes[node].depth for node in frontier]
        extra: list[tuple[int, torch.Tensor, int]] = []  # (row offset, lower tree's ancestors among its nodes, size)
        trees: list[tuple[int, TokenTree, int]] = []  # (hang, lower tree, position of its node 1 in this pass)
        for hang in hangs:
            tree = self._lower_tree(growth, hang)
            if tree is None or len(tree) < 2:
                continue
            at = len(tokens)
            above = [] if hang == 0 else growth.ancestor_slots(hang) + [old + frontier.index(hang)]
            host = tree.host(tokens=True)
            for node, depth in zip(range(1, len(tree)), host.depths()[1:]):
                sees_rows.append(above)
                tokens.append(host.tokens[node])
                depths.append(depth + growth.nodes[hang].depth)
            extra.append((at, host.structure()[1][1:, 1:], len(tree) - 1))  # host: `sees` is built there
            trees.append((hang, tree, at))
        k = len(tokens)
        sees = torch.zeros(k, old + k, dtype=torch.bool)
        for row, slots in enumerate(sees_rows):
            sees[row, slots] = True
        for at, ancestors, size in extra:
            sees[at : at + size, old + at : old + at + size] = ancestors
        timing = self.sizer is not None and not first  # the first pass also feeds the accepted tokens: not comparable
        spent, untimed = self.runner.forward_time if timing else 0.0, self.runner.untimed_passes
        root_logits, logits = self.runner.forward_tree(torch.tensor(tokens, dtype=torch.long),
                                                       torch.tensor(depths, dtype=torch.long), sees,
                                                       growth.ids if first else None)
        if timing and self.runner.untimed_passes == untimed:  # not a pass that compiled
            self.sizer.observe_draft(k, self.runner.forward_time - spent)
        for i, node in enumerate(frontier):
            growth.nodes[node].slot = old + i
        ready = [0, *frontier] if first else frontier
        if first:  # the root's row sits just above the nodes' in the pass's output: one copy puts them together
            logits = torch.cat([root_logits[None], logits])
        lower = {}
        for hang, tree, at in trees:  # their rows follow the frontier's, tree by tree, as fed
            lower[hang] = LowerAt(LowerTree(tree, tree.host(), old + at), at=0)
        return ready, logits, lower

    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        if self.sizer is not None:
            self.sizer.observe_target(tree_size, seconds)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the committed prefix plus the accepted nodes already forwarded; drop every other slot. With a sizer,
        learn how often the target kept a child against the draft's probability of it."""
        self.sequence.extend(input_ids, emitted_tokens(tree, verdict))
        slots = forwarded_prefix([self._slots[node] for node in verdict.path[1:]])
        self.runner.commit(self.sequence.read(input_ids), slots)
        self.grower.learn(tree, verdict, self._logq)


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
