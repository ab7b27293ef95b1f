"""A planned shape sized every step (`sequoia` and `tree` at their defaults): choose, draft, stop early, learn.

Before a step: the shape of the menu with the least predicted time per token (plan/shape_sizing.py), possibly
the root alone (a plain step). While drafting: before each level's pass, the drafted nodes are valued as SpecExec's
sizer values them (a(v) = a(parent) f(q_v), f learned online from the draft's probabilities), the nodes not drafted
yet by the learned positional acceptance below them, and the pass runs only if stopping at some deeper level is
predicted to beat stopping now (`ShapeDepths.best_stop`): an unsure draft stops after fewer levels, and a sure one
grows levels below the shape's deepest nodes (`_deepen`). After: the verdict teaches both acceptance models.

Sampling stays exact with Sequoia's verifier: the shape is chosen from earlier steps only, and an early stop or a
grown level only decides whether nodes already drafted get children, never whether a drafted sibling is kept.

The early stop reads the draft's probabilities before each level's pass, which waits for nothing on a CPU. Elsewhere
(`stop_early`) the chosen shape is drafted whole, as a fixed shape is: nothing is read until the verdict (which
brings the tokens), and what the step teaches (the draft's probabilities, each level pass's time) is read after it,
once. A step then reads twice, and the menu's few shapes are the only pass shapes it meets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.tree import HostTree, TokenTree
from ..core.verdict import Verdict
from ..plan.shape_sizing import RankAcceptance, ShapeChooser, ShapeDepths, ShapeMenu
from ..plan.step_sizing import StepSizer
from ..verify.tree_walk import reads_per_level
from .shaped_tree import ModelTreeDrafter, ShapeLevel


class SizedShapeDrafter(ModelTreeDrafter):
    """`ModelTreeDrafter` over the shape `menu.best` picks each step; deeper levels only while they pay."""

    #: decide before each level's pass whether it pays (a read a level); False: draft the chosen shape whole and
    #: learn after the verdict; None: per level on a CPU, where a read waits for nothing
    stop_early: ClassVar[bool | None] = None

    def __init__(
        self,
        draft_model: PreTrainedModel,
        menu: ShapeMenu,
        sizer: StepSizer,
        ranks: RankAcceptance,
        full_size: int,
        logits_processor: LogitsProcessorList | None = None,
        child_selection: str = "top_k",
        generator: torch.Generator | None = None,
        vocab: int | None = None,
    ) -> None:
        super().__init__(draft_model, [-1], logits_processor, child_selection, generator, vocab)
        self.menu, self.sizer, self.ranks = menu, sizer, ranks
        self.chooser = ShapeChooser(menu, full_size)  # full_size: the method's full tree (a smaller one is shrunk)
        self._logq: torch.Tensor | None = None  # the draft's log-probability of each shape node (device)
        self._host_logq: list[float] | None = None  # read this step (per level: with the tokens; else after it)
        self._per_level = True  # this step decides level by level (`stop_early` resolved on the draft's device)
        self._mark = 0  # the draft clock's passes when the step's first level pass began (drafted whole)
        self._widths: list[int] = []  # the widths of this step's level passes, timed after its verdict
        self._draft_before = 0.0
        self._untimed_before = 0
        self._depths: dict[tuple[int, ...], ShapeDepths] = {}  # per shape drafted: its nodes by depth and rank
        self.deepened_levels = 0  # levels grown below a chosen shape (`_deepen`)
        self._deepest = max(max(HostTree(parents=shape).depths()) for shape in menu.shapes)

    @property
    def num_drafting_tokens(self) -> int:  # the deepest shape of the menu: the one used may change every step
        return self._deepest

    @property
    def shrunk_steps(self) -> int:
        return self.chooser.shrunk_steps

    @property
    def size_probes(self) -> int:
        return self.chooser.size_probes

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        self._per_level = reads_per_level(self.stop_early, self.runner.device)
        self._host_logq, self._widths = None, []
        self.use_shape(self.menu.shapes[self.chooser.choose(self.sizer, self.ranks)])
        tree = super().propose(input_ids)
        self.chooser.shrunk(len(tree))
        return tree

    # --- the hooks of ModelTreeDrafter.propose ---------------------------------------------------------
    def _step_started(self, tokens: torch.Tensor) -> None:
        self._logq = torch.full((len(tokens),), -math.inf, device=tokens.device)
        self._logq[0] = 0.0

    def _level_drafted(self, level: ShapeLevel, kids: torch.Tensor, logq: Callable[[], torch.Tensor]) -> None:
        # the root's pass also fed the accepted tokens, a compiling pass compiled: not comparable timings
        if not self._per_level:  # timed after the verdict (`_observe_passes`): asking now would wait for the pass
            if level.parent_list[0] == 0:
                self._mark, self._untimed_before = self.runner.clock.passes, self.runner.untimed_passes
            else:
                self._widths.append(len(level.parent_list))
        else:
            if level.parent_list[0] != 0 and self.runner.untimed_passes == self._untimed_before:
                self.sizer.observe_draft(len(level.parent_list), self.runner.forward_time - self._draft_before)
            self._draft_before, self._untimed_before = self.runner.forward_time, self.runner.untimed_passes
        self._logq[level.children] = logq()[level.rows, level.cols]

    def _observe_passes(self) -> None:
        """A step drafted whole: each level pass's time, now that the verdict's read has waited for them all."""
        if self._widths and self.runner.untimed_passes == self._untimed_before:
            for width, seconds in zip(self._widths, self.runner.clock.seconds_since(self._mark)):
                self.sizer.observe_draft(width, seconds)

    def _level_pays(self, index: int) -> bool:
        """The pass of level `index` runs if some deeper stop is predicted to lower the time per token (one read: the
        draft's probabilities so far); drafted whole, every level runs."""
        if not self._per_level:
            return True
        values = self._values(self._logq.tolist())
        return self._shape_depths(self.host_shape.parents).best_stop(values, index, self.ranks.vectors(),
                                                                     self.sizer) > index

    def _shape_depths(self, parents: list[int]) -> ShapeDepths:
        key = tuple(parents)
        if key not in self._depths:
            self._depths[key] = ShapeDepths.of(parents)
        return self._depths[key]

    def _deepen(self) -> bool:
        """Drafted level by level, the chosen shape's last level done: grow one more level, a child under the deepest
        node likeliest to be kept, where drafting it is predicted to lower the time per token (`ShapeDepths.best_stop`
        on the grown shape, the drafted nodes valued by the draft's own probabilities: `_level_pays`'s test). The
        menu's shapes are priced by positional acceptance alone; a draft that stays sure along a path (a quoted or
        repeated stretch) earns more levels than any of them has. No deeper than the menu's deepest shape."""
        if not self._per_level:
            return False
        parents, depths = self.host_shape.parents, self.host_shape.depths()
        room = self.num_drafting_tokens - depths[-1]
        if room <= 0:
            return False
        values = self._values(self._logq.tolist())
        leaf = max((node for node, depth in enumerate(depths) if depth == depths[-1]), key=values.__getitem__)
        if values[leaf] <= 0.0:
            return False
        grown = [*parents, leaf]
        if self._shape_depths(grown).best_stop([*values, 0.0], depths[-1], self.ranks.vectors(),
                                               self.sizer) <= depths[-1]:
            return False
        self.use_shape(grown)
        self._logq = torch.cat([self._logq, self._logq.new_full((1,), -math.inf)])
        self.deepened_levels += 1
        return True

    def _values(self, logq: list[float]) -> list[float]:
        """a(v) per shape node: the chance the target keeps v's path, by the learned f(q) (0 where not drafted)."""
        logf = self.sizer.acceptance.log_rates(logq)
        values = [1.0] * len(logq)
        for node, parent in enumerate(self.host_shape.parents[1:], start=1):
            values[node] = values[parent] * math.exp(logf[node]) if math.isfinite(logf[node]) else 0.0
        return values

    def _read_tokens(self, tokens: torch.Tensor) -> list[int] | None:
        """Tokens and their draft log-probabilities in one final read, where the step decided level by level; drafted
        whole, nothing (the verdict brings the tokens, `accept` reads the probabilities)."""
        if not self._per_level:
            return None
        token_list, self._host_logq = torch.stack([tokens.double(), self._logq.double()]).tolist()
        return [int(t) for t in token_list]

    # --- learning -------------------------------------------------------------------------------------
    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        self.sizer.observe_target(tree_size, seconds)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        super().accept(input_ids, tree, verdict)
        if len(tree) < 2 or len(self._kept) != len(tree):
            return  # a plain step (or a tree this drafter did not propose): nothing drafted to learn from
        if self._host_logq is None:  # drafted whole: learnt from after the verdict, in one read
            self._observe_passes()
            self._host_logq = self._logq.tolist()
        logq = [self._host_logq[node] for node in self._kept]
        # a node the draft could not fill (-inf: kept in a tree drafted whole) was never a candidate
        children = [[c for c in kids if math.isfinite(logq[c])] for kids in tree.host().children()]
        path = verdict.path
        self.ranks.learn(children, path, verdict.accepted_ranks)
        reached = set(path)
        kids = [c for node in path for c in children[node]]
        self.sizer.acceptance.update([logq[c] for c in kids], [c in reached for c in kids])
