"""A planned shape sized every step (`sequoia` and `tree` at their defaults): choose, draft, stop early, learn.

Before a step: the shape of the menu with the least predicted time per token (plan/shape_sizing.py), possibly
the root alone (a plain step). While drafting: before each level's pass, the drafted nodes are valued as SpecExec's
sizer values them (a(v) = a(parent) f(q_v), f learned online from the draft's probabilities), the nodes not drafted
yet by the learned positional acceptance below them, and the pass runs only if stopping at some deeper level is
predicted to beat stopping now (`ShapeDepths.best_stop`): an unsure draft stops after fewer levels. After: the
verdict teaches both acceptance models.

Sampling stays exact with Sequoia's verifier: the shape is chosen from earlier steps only, and an early stop only
decides whether nodes already drafted get children, never whether a drafted sibling is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.tree import HostTree, TokenTree
from ..core.verdict import Verdict
from ..plan.shape_sizing import RankAcceptance, ShapeChooser, ShapeDepths, ShapeMenu
from ..plan.step_sizing import StepSizer
from .shaped_tree import ModelTreeDrafter, ShapeLevel


class SizedShapeDrafter(ModelTreeDrafter):
    """`ModelTreeDrafter` over the shape `menu.best` picks each step; deeper levels only while they pay."""

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
        self._host_logq: list[float] = []
        self._draft_before = 0.0
        self._untimed_before = 0
        self._depths: dict[tuple[int, ...], ShapeDepths] = {}  # per shape drafted: its nodes by depth and rank

    @property
    def num_drafting_tokens(self) -> int:  # the deepest shape of the menu: the one used may change every step
        return max(max(HostTree(parents=shape).depths()) for shape in self.menu.shapes)

    @property
    def shrunk_steps(self) -> int:
        return self.chooser.shrunk_steps

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
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
        if level.parent_list[0] != 0 and self.runner.untimed_passes == self._untimed_before:
            self.sizer.observe_draft(len(level.parent_list), self.runner.forward_time - self._draft_before)
        self._draft_before, self._untimed_before = self.runner.forward_time, self.runner.untimed_passes
        self._logq[level.children] = logq()[level.rows, level.cols]

    def _level_pays(self, index: int) -> bool:
        """The pass of level `index` runs if some deeper stop is predicted to lower the time per token (one read: the
        draft's probabilities so far)."""
        values = self._values(self._logq.tolist())
        key = tuple(self.host_shape.parents)
        if key not in self._depths:
            self._depths[key] = ShapeDepths.of(self.host_shape.parents)
        return self._depths[key].best_stop(values, index, self.ranks.vectors(), self.sizer) > index

    def _values(self, logq: list[float]) -> list[float]:
        """a(v) per shape node: the chance the target keeps v's path, by the learned f(q) (0 where not drafted)."""
        logf = self.sizer.acceptance.log_rates(logq)
        values = [1.0] * len(logq)
        for node, parent in enumerate(self.host_shape.parents[1:], start=1):
            values[node] = values[parent] * math.exp(logf[node]) if math.isfinite(logf[node]) else 0.0
        return values

    def _read_tokens(self, tokens: torch.Tensor) -> list[int]:
        """Tokens and their draft log-probabilities in the step's one final read."""
        token_list, self._host_logq = torch.stack([tokens.double(), self._logq.double()]).tolist()
        return [int(t) for t in token_list]

    # --- learning -------------------------------------------------------------------------------------
    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        self.sizer.observe_target(tree_size, seconds)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        super().accept(input_ids, tree, verdict)
        if len(tree) < 2 or len(self._kept) != len(tree):
            return  # a plain step (or a tree this drafter did not propose): nothing drafted to learn from
        children = tree.host().children()
        path = verdict.path
        self.ranks.learn(children, path, verdict.accepted_ranks)
        reached = set(path)
        kids = [c for node in path for c in children[node]]
        self.sizer.acceptance.update([self._host_logq[self._kept[c]] for c in kids], [c in reached for c in kids])
