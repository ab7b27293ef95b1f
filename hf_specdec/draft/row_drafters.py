"""A batch's rows drafted row by row: one `Drafter` per row (any method's), behind one measured guard for the batch's
whole steps. The batch drafter `decoding.batch_loop` takes for methods that draft a tree of their own per row
(staged, prompt lookup); a fixed shape is drafted for every row at once instead (`batch_shaped.py`), and so are
`specexec`'s best-first trees (`methods.specexec.lockstep`)."""

from __future__ import annotations

import time

import torch

from ..core.drafter import Drafter
from ..core.tree import TokenTree
from ..core.verdict import Verdict
from ..plan.guard import PlainGuard
from .guarded import root_only


class RowDrafters:
    """One `Drafter` per row (any method's: its own draft cache, plan and state), drafting row by row. The batch
    drafter contract `batch_speculative_loop` takes; `draft.batch_shaped.LockstepShapeDrafter` is the other."""

    def __init__(self, drafters: list[Drafter], guard: PlainGuard | None = None) -> None:
        self.drafters = drafters
        self.active = list(range(len(drafters)))  # the drafter of each batch row still decoding
        # the measured guard watches whole steps, every row's drafting and tokens together (a row's own guard
        # would read the other rows' drafting as the target's time, and plain steps as dear): plain batched steps
        # while the rows' trees keep losing to them
        self.guard = guard
        self._step = (0.0, 0.0, False, 0)  # the last step's start, every drafter's pass time then, plain, rows
        self._tokens, self._steps = 0, 0  # every row's tokens of the last step; steps proposed
        self.sized_rows = 1  # the rows the drafters last priced their trees among (`Drafter.share_rows`)

    def propose(self, ids: list[list[int]], prefixes: list[torch.Tensor],
                unpadded: list[torch.LongTensor]) -> list[TokenTree]:
        if len(self.active) != self.sized_rows:
            self.sized_rows = len(self.active)
            for drafter in self.drafters:
                drafter.share_rows(self.sized_rows)
        if self.guard is not None and self._plain_step():  # every row's root alone; each drafter catches up later
            return [root_only(tokens[-1], sequence.device) for tokens, sequence in zip(ids, unpadded)]
        return [self.drafters[row].propose(sequence) for row, sequence in zip(self.active, unpadded)]

    def _plain_step(self) -> bool:
        """Hand the guard the last step (whole: every row's drafting and tokens); whether this one runs plain."""
        now, drafting = time.perf_counter(), sum(drafter.forward_time for drafter in self.drafters)
        if self._steps > 1:  # not the first step: the drafters' first passes read every row's prompt
            began, drafted, plain, rows = self._step
            self.guard.observe(now - began, self._tokens, plain, drafting - drafted, rows=rows)
        plain = self.guard.plain_next(len(self.active))
        self._step, self._tokens, self._steps = (now, drafting, plain, len(self.active)), 0, self._steps + 1
        return plain

    def accept(self, index: int, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        self.drafters[self.active[index]].accept(input_ids, tree, verdict)

    def observe_step(self, sizes: list[int], seconds: float, emitted: list[int]) -> None:
        """The step's target pass took `seconds`: each row's drafter sees its share of a pass over every row padded
        to the largest tree (what its curves, shared among the rows, price)."""
        for row in self.active:
            self.drafters[row].observe_target_pass(max(sizes), seconds / len(sizes))
        self._tokens = sum(emitted)

    def drop(self, keep: list[int]) -> None:
        self.active = [self.active[index] for index in keep]

    def counts(self, row: int) -> tuple[int, float]:
        return self.drafters[row].forward_count, self.drafters[row].forward_time

    def shrunk_steps(self, row: int) -> int:
        return self.drafters[row].shrunk_steps

    def size_probes(self, row: int) -> int:
        return self.drafters[row].size_probes
