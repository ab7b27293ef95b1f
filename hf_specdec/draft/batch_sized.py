"""A batch's shape sized every step: of a menu of shapes (the method's shape and its smaller versions, or the Sequoia
DP's trees), every row drafts, in lockstep, the one with the least predicted time per token for the batch, down to
a plain batched step (every row's root alone, no draft pass) when no tree pays.

The cost model is the single sequence's (`plan.shape_sizing.ShapeMenu` with the `StepSizer`'s corrected curves),
with the curves as a batch of the rows still decoding sees them (`plan.sizing.for_batch`: a pass over n nodes per
row costs what rows * n tokens cost, so the trees shrink as the batch grows) and the tokens the slowest row is
expected to add (every row drafts the shape, and the call lasts as long as that row takes), each row with the
positional acceptance learned from its own verdicts (`RankAcceptance`). The measured guard
(`plan.guard.PlainGuard`) watches whole steps, every row's tokens together: a batch whose steps keep losing to plain
batched steps runs plain ones, and probes again later. Without curves (no `sizer`) the menu's largest shape is
drafted every step, behind the guard alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.tree import TokenTree
from ..plan.guard import PlainGuard
from ..plan.shape_sizing import RankAcceptance, ShapeChooser, ShapeMenu
from ..plan.sizing import HardwareProfile, for_batch
from ..plan.step_sizing import StepSizer
from .batch_shaped import LockstepShapeDrafter


class SizedLockstepDrafter(LockstepShapeDrafter):
    """`LockstepShapeDrafter` over the shape of `menu` chosen every step for the rows still decoding."""

    def __init__(
        self,
        draft_model: PreTrainedModel,
        menu: ShapeMenu,
        sizer: StepSizer | None,
        ranks: Sequence[RankAcceptance],
        full_size: int,
        rows: int,
        logits_processor: LogitsProcessorList | list[LogitsProcessorList | None] | None = None,
        child_selection: str = "top_k",
        generator: torch.Generator | None = None,
        vocab: int | None = None,
        guard: PlainGuard | None = None,
        threshold: float | None = None,
    ) -> None:
        super().__init__(draft_model, [-1], rows, logits_processor, child_selection, generator, vocab, threshold)
        self.menu, self.sizer, self.guard = menu, sizer, guard
        self.chooser = ShapeChooser(menu, full_size)  # full_size: the method's full tree (a smaller one is shrunk)
        self.single = sizer.profile if sizer is not None else None  # the curves of one sequence
        self._profiles: dict[int, HardwareProfile] = {}  # rows -> the curves as that many rows see them
        self.ranks = list(ranks)  # the acceptance learned per batch row still decoding
        self.shrunk = [0] * rows  # per row of the call: steps whose tree was cut below the full shape
        self.probed = [0] * rows  # per row of the call: its steps that were the chooser's size probes
        self.choices: list[tuple[int, int]] = []  # every step's (rows, nodes of its shape); 1 node: plain batched

    def batch_profile(self, rows: int) -> HardwareProfile:
        if rows not in self._profiles:
            self._profiles[rows] = for_batch(self.single, rows)
        return self._profiles[rows]

    def propose(self, ids: list[list[int]], prefixes: list[torch.Tensor], unpadded=None) -> list[TokenTree]:
        if self.guard_says_plain(len(ids)):
            choice = 0
        elif self.sizer is None:
            choice = max(range(len(self.menu.shapes)), key=lambda index: len(self.menu.shapes[index]))
        else:
            self.sizer.profile = self.batch_profile(len(ids))
            probes = self.chooser.size_probes
            choice = self.chooser.choose(self.sizer, self.ranks)
            for row in self.origin if self.chooser.size_probes > probes else ():
                self.probed[row] += 1
        shape = self.menu.shapes[choice]
        self.use_shape(shape)
        self.choices.append((len(ids), len(shape)))
        self.step_kind(choice == 0, len(ids))
        trees = super().propose(ids, prefixes, unpadded)
        for row, tree in zip(self.origin, trees):
            self.shrunk[row] += 1 < len(tree) < self.chooser.full_size
        return trees

    def _level_timed(self, nodes: int, seconds: float) -> None:
        if self.sizer is not None:
            self.sizer.observe_draft(nodes, seconds)

    def observe_step(self, sizes: list[int], seconds: float, emitted: list[int]) -> None:
        if self.sizer is not None:
            self.sizer.observe_target(max(sizes), seconds)  # one pass, every row padded to the largest tree
        self.step_emitted(emitted)

    def accept(self, index: int, input_ids: torch.Tensor, tree: TokenTree, verdict) -> None:
        super().accept(index, input_ids, tree, verdict)
        if self.ranks and len(tree) > 1:
            self.ranks[index].learn(tree.host().children(), verdict.path, verdict.accepted_ranks)

    def drop(self, keep: list[int]) -> None:
        super().drop(keep)
        self.ranks = [self.ranks[index] for index in keep] if self.ranks else []

    def shrunk_steps(self, row: int) -> int:
        return self.shrunk[row]

    def size_probes(self, row: int) -> int:
        return self.probed[row]
