"""SpecExec's best-first trees for a batch: every row grows its own tree, and each draft pass forwards every row's
frontier at once.

Drafted row by row (`draft.row_drafters.RowDrafters`), a batch of B rows pays B draft passes for each round of
expansion, each over one row's few nodes: on a GPU every pass costs its launches whatever its size, so 8 rows
drafted that way lost to plain batched decoding (0.59x of it on an H100, where `sequoia`'s lockstep shapes ran
1.45x). Here the rows share one draft cache, ragged like the target's (`draft.batch_draft.LockstepDraft`): the first
pass of a step feeds every row what its cache lacks and gives the roots' logits; then each round forwards, in one
pass, the nodes each row's `Grower` picks (rows picking fewer are padded with nodes that see only themselves), and
each row's grower adds their children, as one sequence's `BestFirstDrafter` does after its own pass. The rounds go on
while any row's grower asks for another pass. Each row keeps its own processors and cost model (with the curves as
the batch sees them, `plan.sizing.for_batch`: a pass over n nodes a row is one over B x n tokens, and no row's tree
grows past what the curves measured).
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ...core.tree import TokenTree
from ...core.verdict import Verdict
from ...draft.batch_draft import LockstepDraft
from ...draft.draft_model import forwarded_prefix
from ...draft.guarded import root_only
from ...plan.guard import PlainGuard
from ...plan.sizing import HardwareProfile, for_batch
from .best_first import Grower, Growth, Node


class LockstepBestFirstDrafter(LockstepDraft):
    """Every row's best-first tree (`growers[r]`, each with its row's processors and cost model), its frontier
    forwarded with the other rows' in one draft pass per round, behind the batch's `guard`."""

    def __init__(self, draft_model: PreTrainedModel, growers: list[Grower], vocab: int | None = None,
                 guard: PlainGuard | None = None) -> None:
        super().__init__(draft_model, len(growers), vocab)
        self.growers, self.guard = list(growers), guard
        sizers = [grower.sizer for grower in growers if grower.sizer is not None]
        self.single: HardwareProfile | None = sizers[0].profile if sizers else None  # the curves of one sequence
        self._slots: list[list[int]] = [[] for _ in growers]  # per row: the draft-cache column of each tree node
        self._logq: list[list[float]] = [[] for _ in growers]  # per row: the draft's log-probability of each node
        self._share(len(growers))

    def _share(self, rows: int) -> None:
        """Every row prices its tree on the curves as a batch of `rows` rows drafting in lockstep sees them."""
        if self.single is not None:
            profile = for_batch(self.single, rows, measured_only=True)
            for grower in self.growers:
                if grower.sizer is not None:
                    grower.sizer.profile = profile

    def propose(self, ids: list[list[int]], prefixes: list[torch.Tensor], unpadded=None) -> list[TokenTree]:
        """The trees of every row: `ids[r]` the row's tokens (its root last), `prefixes[r]` `(1, L)` what the call's
        processors see before row r's root. A plain step (the guard's) is every row's root alone."""
        plain = self.guard_says_plain(len(ids))
        self.step_kind(plain, len(ids))
        if plain:  # the rows catch up with what they emitted in the next drafted step
            self.keep_accepted(len(ids))
            self._slots = [[-1] for _ in ids]
            return [root_only(row[-1], self.device) for row in ids]
        start, device = time.perf_counter(), self.device
        root_logits = self.catch_up(ids)
        growths = [Growth(nodes=[Node(token=row[-1], parent=-1, depth=0, log_rank=0.0, logq=0.0)],
                          prefix=prefix.to(device), ids=row) for row, prefix in zip(ids, prefixes)]
        self._grow(growths, [[0]] * len(ids), root_logits[:, None])
        passes = 1
        while True:
            seconds = time.perf_counter() - start
            frontiers = [grower.frontier(growth, passes, seconds) for grower, growth in zip(self.growers, growths)]
            width = max(len(frontier) for frontier in frontiers)
            if width == 0:
                break
            timed = any(grower.sizer is not None for grower in self.growers)  # on CUDA, asking the clock waits
            before = self.clock.total if timed else 0.0
            logits = self._frontier_pass(growths, frontiers, width)
            if timed:
                self._observe_draft(width, self.clock.total - before)
            passes += 1
            self._grow(growths, frontiers, logits)
        seconds = time.perf_counter() - start
        trees = []
        for row, (grower, growth) in enumerate(zip(self.growers, growths)):
            grower.finish(growth, seconds)
            tree, self._slots[row], self._logq[row] = grower.output(growth, device)
            trees.append(tree)
        return trees

    def _grow(self, growths: list[Growth], ready: list[list[int]], logits: torch.Tensor) -> None:
        """Every row's nodes `ready[r]` got logits (`logits[r]`'s first rows): each row's grower adds their children,
        all rows' picks read at once (one read a round, where a row drafter reads once per row)."""
        rows = [row for row, nodes in enumerate(ready) if nodes]
        picks = [self.growers[row].picks(growths[row], ready[row], logits[row, : len(ready[row])], {}) for row in rows]
        read = torch.cat(picks).tolist()  # the round's one read
        start = 0
        for row in rows:
            end = start + len(ready[row])
            self.growers[row].grow_from(growths[row], ready[row], read[start:end], {})
            start = end

    def _frontier_pass(self, growths: list[Growth], frontiers: list[list[int]], width: int) -> torch.Tensor:
        """One pass over every row's `frontier` (padded to `width` nodes a row with nodes that see only themselves):
        each node sees its row's committed columns and its forwarded ancestors' columns. Each forwarded node takes
        its column (`Node.slot`); the logits `(B, width, vocab)`."""
        old, batch = self.node_slots, len(growths)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        depths = torch.ones(batch, width, dtype=torch.long)
        sees = torch.zeros(batch, width, old + width, dtype=torch.bool)
        sees[:, :, old:] = torch.eye(width, dtype=torch.bool)
        for row, (growth, frontier) in enumerate(zip(growths, frontiers)):
            for i, node in enumerate(frontier):
                tokens[row, i], depths[row, i] = growth.nodes[node].token, growth.nodes[node].depth
                sees[row, i, growth.ancestor_slots(node)] = True
                growth.nodes[node].slot = old + i
        return self.node_pass(tokens.to(self.device, non_blocking=True), depths, sees)

    def _observe_draft(self, width: int, seconds: float) -> None:
        """A round's pass over `width` nodes a row took `seconds`: what each row's cost model corrects its draft
        curve with (the batch's, as `_share` gave it)."""
        for grower in self.growers:
            if grower.sizer is not None:
                grower.sizer.observe_draft(width, seconds)

    def accept(self, index: int, input_ids: torch.Tensor, tree: TokenTree, verdict: Verdict) -> None:
        """Batch row `index` keeps the columns of the accepted nodes the draft forwarded (a prefix of the accepted
        path); its cost model learns how often the target kept a child against the draft's probability of it."""
        self.kept_slots[index] = forwarded_prefix([self._slots[index][node] for node in verdict.path[1:]])
        if len(tree) > 1:
            self.growers[index].learn(tree, verdict, self._logq[index])

    def observe_step(self, sizes: list[int], seconds: float, emitted: list[int]) -> None:
        """The step's target pass over trees of `sizes` nodes took `seconds` (one pass, every row padded to the
        largest tree); the rows emitted `emitted` tokens."""
        if max(sizes) > 1:
            for grower in self.growers:
                if grower.sizer is not None:
                    grower.sizer.observe_target(max(sizes), seconds)
        self.step_emitted(emitted)

    def drop(self, keep: list[int]) -> None:
        super().drop(keep)
        self.growers = [self.growers[index] for index in keep]
        self._slots = [self._slots[index] for index in keep]
        self._logq = [self._logq[index] for index in keep]
        self._share(len(keep))

    def shrunk_steps(self, row: int) -> int:
        return 0

    def size_probes(self, row: int) -> int:
        return 0


def lockstep_drafter(config, target: PreTrainedModel, draft: PreTrainedModel,
                     processors: list[LogitsProcessorList | None], vocab: int, guard: PlainGuard | None
                     ) -> LockstepBestFirstDrafter:
    """A batch's `specexec` drafter for `config` (a `SpecExecConfig`): each row's grower as its single-sequence
    drafter would have it (its budget or cost model, its row's processors)."""
    growers = [Grower(**config.growth(target, draft, row_processors)) for row_processors in processors]
    return LockstepBestFirstDrafter(draft, growers, vocab, guard)
