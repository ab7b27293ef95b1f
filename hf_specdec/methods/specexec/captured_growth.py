"""SpecExec's best-first growth as device work of fixed shapes: the tree of a captured step (decoding/captured.py).

The loop's growth (`best_first.py`) decides on the host after every draft pass which nodes the next one forwards and
whether to go on. A step captured whole decides nothing on the host, so here every step runs the same passes:
1. the root's children come with the draft's catch-up pass (its `width` most probable tokens);
2. each of `passes` draft passes forwards the `beams` most probable unexpanded nodes (by cumulative draft
   log-probability: a top-k over a fixed pool of nodes), and each adds its `width` most probable children to the pool;
3. the target verifies the pool's `nodes` most probable nodes.
A child is always less probable than its parent (a log-probability is at most 0, and a tiny per-level tie break makes
it strict), so the chosen nodes form a connected tree, and every mask follows from an ancestor matrix kept on the
device. Nodes rank by the draft's log-probabilities: raw ones greedily, the processed rows (temperature, top-k,
top-p) when the call samples, as the loop's growth ranks them; a sampled tree is verified by target sampling, which
is exact whatever the tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...draft.captured_tree import CATCH_UP, DraftedTree
from ...logits.wide_rows import row_topk
from ...plan.shape_sizing import CAPTURED_SIZES
from ...plan.step_sizing import StepSizer
from ...runtime.pass_shapes import PaddedTree, padded_size
from .best_first import default_beams

#: subtracted from a node's cumulative log-probability per level when the verified nodes are chosen: a child whose
#: draft probability rounds to 1 still ranks below its parent, so no node is chosen without its parent
TIE_BREAK = 1e-6
#: the chosen nodes' draft log-probabilities cross to the host in the step's one read of longs, in these units
LOGQ_UNIT = 1e-6
UNFILLED = -(10**12)  # a node the draft filled no token for (log-probability -inf)


@dataclass(frozen=True)
class GrowthSpec:
    """One captured best-first shape: what every step of it drafts and verifies (hashable: one compiled function
    each)."""

    nodes: int  # verified, the root included
    beams: int  # nodes forwarded per draft pass after the catch-up
    width: int  # children added per forwarded node
    passes: int  # draft passes after the catch-up
    max_depth: int  # deepest drafted level

    @classmethod
    def of(cls, budget: int, width: int, beams: int | None, max_depth: int) -> GrowthSpec:
        """The captured shape of a fixed `budget`: enough passes to forward every verified node but the root
        (`budget - 1` expansions at `beams` a pass), and no more than its depth can use."""
        beams = beams or default_beams(budget)
        return cls(budget, beams, width, min(math.ceil((budget - 1) / beams), max_depth - 1), max_depth)

    @property
    def pool(self) -> int:
        return 1 + self.width + self.passes * self.beams * self.width

    @property
    def size(self) -> int:
        """The target pass's rows (padded)."""
        return padded_size(self.nodes)

    @property
    def depth(self) -> int:
        """The deepest node the tree can have."""
        return min(self.max_depth, self.passes + 1)

    @property
    def draft_passes(self) -> int:
        return 1 + self.passes

    @property
    def draft_pass_sizes(self) -> set[int]:
        return {self.beams} if self.passes else set()

    def within(self, target_rows: int, draft_rows: int, deepest: int | None) -> GrowthSpec | None:
        """This shape cut to what is left: `target_rows` for the target's pass, `draft_rows` for the draft's passes
        after its catch-up, nodes no deeper than `deepest` (None: no limit); None where no child fits (the root
        alone: a plain step)."""
        max_depth = self.max_depth if deepest is None else min(self.max_depth, deepest)
        passes = max(min(self.passes, max_depth - 1, draft_rows // self.beams), 0)
        nodes = min(self.nodes, 1 + self.width + passes * self.beams * self.width)
        while padded_size(nodes) > target_rows:
            nodes = padded_size(nodes) // 2
        if max_depth < 1 or nodes < 2:
            return None
        return GrowthSpec(nodes, self.beams, self.width, passes, max_depth)

    def draft(self, step, logits: torch.Tensor, past: torch.Tensor, root: torch.Tensor) -> DraftedTree:
        """Grow the tree (see the module's notes) with `step`'s draft (`CapturedStep`: its `_draft_pass` on the draft's
        static cache after `past` committed rows), from the root's logits `(1, V)`; the root's token `root` `(1,)`."""
        ddev, width, beams = step.draft_device, self.width, self.beams
        on = {"dtype": torch.long, "device": ddev}
        tokens = torch.full((self.pool,), -1, **on)
        tokens[:1] = root
        parents, depths, slots = (torch.zeros(self.pool, **on) for _ in range(3))
        ranks = torch.full((self.pool,), float("-inf"), device=ddev)
        ranks[0] = 0.0
        logqs = torch.zeros(self.pool, device=ddev)  # each node's draft log-probability under its parent
        expanded, forwarded = (torch.zeros(self.pool, dtype=torch.bool, device=ddev) for _ in range(2))
        ancestors = torch.eye(self.pool, dtype=torch.bool, device=ddev)
        frontier, live, sent, added = torch.zeros(1, **on), torch.ones(1, dtype=torch.bool, device=ddev), [], 1
        for index in range(self.passes + 1):
            if index:  # 2. the most probable open nodes, forwarded after the ones before them
                key = torch.where(~expanded & (depths < self.max_depth), ranks, float("-inf"))
                frontier = key.topk(beams).indices
                live = key.index_select(0, frontier) > float("-inf")  # else picked for want of open nodes
                earlier = torch.cat(sent) if sent else torch.zeros(0, **on)
                seen = torch.cat([ancestors[frontier][:, earlier], torch.eye(beams, dtype=torch.bool, device=ddev)], 1)
                rows = PaddedTree(depths[frontier], seen, torch.ones(beams, 1, dtype=torch.bool, device=ddev),
                                  torch.cat([depths[earlier], depths[frontier]]))
                positions, masks = rows.inputs(past, step.draft_width, step.draft_layout, step.draft.dtype,
                                               origin=past - 1)
                logits = step._draft_pass(tokens[frontier].clamp(min=0), positions, masks)
                slots[frontier] = torch.where(live, (index - 1) * beams + torch.arange(beams, device=ddev),
                                              slots[frontier])
                forwarded[frontier] |= live
                sent.append(frontier)
            expanded[frontier] = True
            if step.sampling is not None:  # ranked by the rows sampling draws from, as the loop's growth ranks them
                logits = step.sampling.scores(logits)
            values, picked = row_topk(logits, width)
            filled = live[:, None] & (values > float("-inf"))
            children = added + torch.arange(len(frontier) * width, device=ddev)
            above = frontier.repeat_interleave(width)
            tokens[children] = torch.where(filled, picked, -1).flatten()
            parents[children], depths[children] = above, depths[above] + 1
            logq = values - logits.logsumexp(-1, keepdim=True)
            ranks[children] = torch.where(filled, ranks[frontier][:, None] + logq, float("-inf")).flatten()
            logqs[children] = torch.where(filled, logq, float("-inf")).flatten()
            ancestors[children] = ancestors[above] | ancestors[children]  # its own column is set by the eye
            added += len(frontier) * width
        # 3. the verified nodes: the most probable (the root first), a connected tree
        key = ranks - TIE_BREAK * depths
        key[0] = float("inf")
        chosen = key.topk(self.nodes).indices
        place = torch.zeros(self.pool, **on).index_copy(0, chosen, torch.arange(self.nodes, **on))
        return self._tree(step.target_device, tokens[chosen], place[parents[chosen]], depths[chosen],
                          ancestors[chosen][:, chosen], slots[chosen], forwarded[chosen], logqs[chosen])

    def _tree(self, device: torch.device, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
              ancestors: torch.Tensor, slots: torch.Tensor, forwarded: torch.Tensor, logqs: torch.Tensor
              ) -> DraftedTree:
        """The chosen nodes as the target's padded pass takes them (padding rows see only themselves); the host
        learns from their parents and log-probabilities (`GrowthSchedule`), read with the step's verdict."""
        n, size = self.nodes, self.size
        tokens, parents, depths, ancestors = (t.to(device) for t in (tokens, parents, depths, ancestors))
        seen = torch.eye(size, dtype=torch.bool, device=device)
        seen[:n, :n] = ancestors
        rows = torch.cat([depths, depths[:1].expand(size - n)])
        target_rows = PaddedTree(rows, seen, (torch.arange(size, device=device) < n)[:, None], rows)
        units = (logqs / LOGQ_UNIT).round().clamp(min=UNFILLED).long().to(device)  # one long read with the verdict
        return DraftedTree(tokens, parents, depths, ancestors, target_rows, slots, forwarded,
                           learned=torch.cat([parents, units]))


class GrowthSchedule:
    """The captured shape of each step of `specexec` sized every step: one of a few budgets (`CAPTURED_SIZES`, one
    compiled function each), chosen before the step from the tree the step before grew.

    That tree's nodes, rated by the drafter's cost model (`StepSizer`: the chance the target keeps a node given the
    draft's probability of it, learned from every verdict, times its parent's; the latency curves), price each
    budget: seconds a step over the tokens it is expected to keep. Budgets up to the tree's own are priced by its
    best nodes; a larger one by extending the tree's falling values (what its last bucket's nodes added over the
    ones before, once more per doubling), since its nodes were not drafted. The first step grows the middle budget.
    The latency curves are not corrected from measured passes (a captured step is timed whole)."""

    def __init__(self, sizer: StepSizer, width: int, max_depth: int, max_budget: int) -> None:
        sizes = [size for size in CAPTURED_SIZES if size <= min(max_budget, sizer.max_nodes)] or [CAPTURED_SIZES[0]]
        self.sizer, self.menu = sizer, [GrowthSpec.of(size, width, None, max_depth) for size in sizes]
        self.choice, self.shrunk_steps = len(self.menu) // 2, 0

    def next(self) -> GrowthSpec:
        self.shrunk_steps += self.choice < len(self.menu) - 1
        return self.menu[self.choice]

    def learn(self, spec: GrowthSpec, learned: list[int], path: list[int]) -> None:
        """A step over `spec` read `learned` (`DraftedTree.learned`: the chosen nodes' parents, then their draft
        log-probabilities in `LOGQ_UNIT`s) and kept `path` (its nodes, root first)."""
        n = len(learned) // 2
        parents = learned[:n]
        logq = [value * LOGQ_UNIT if value > UNFILLED else float("-inf") for value in learned[n:]]
        reached = set(path)
        children = [node for node in range(1, n) if parents[node] in reached and math.isfinite(logq[node])]
        self.sizer.acceptance.update([logq[c] for c in children], [c in reached for c in children])
        rates, log_values = self.sizer.acceptance.log_rates(logq), [0.0] * n
        for node in range(1, n):  # parents first: the nodes were chosen by falling rank
            log_values[node] = log_values[parents[node]] + rates[node]
        values = sorted((math.exp(v) for v in log_values[1:]), reverse=True)
        self.choice = int(min(range(len(self.menu)), key=lambda i: self._seconds_per_token(self.menu[i], values)))

    def _seconds_per_token(self, spec: GrowthSpec, values: list[float]) -> float:
        """Predicted seconds per token of a step over `spec`, from a tree's node values `values` (descending)."""
        expected, kept = 1.0 + math.fsum(values[: spec.nodes - 1]), len(values)
        if spec.nodes - 1 > kept and kept >= 2:  # not drafted: each doubling adds what the last half added, scaled
            half = kept // 2
            head, tail = math.fsum(values[:half]), math.fsum(values[half:])
            added, size = tail, kept
            while size < spec.nodes - 1:
                added, size = added * tail / max(head, 1e-12), 2 * size
                expected += added
        sizer = self.sizer
        seconds = (sizer.draft_seconds(CATCH_UP) + spec.passes * sizer.draft_seconds(spec.beams)
                   + sizer.target_seconds(spec.size) + sizer.profile.step_overhead)
        return float(seconds) / expected
