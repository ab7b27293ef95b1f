"""`speculation="tree"`: a static tree shape of your choice, drafted level by level."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...core.config import PlanRequest, register_speculation, set_by_with_plan
from ...draft.shaped_tree import ModelTreeDrafter
from ...plan.shape_sizing import ShapeMenu, sub_shapes_menu
from ...plan.shapes import validate_parents, widths_parents
from ..static_shape import StaticShapeConfig
from ..step_sized import PLAN_BUDGET

# Wide and shallow: on a 2-core CPU a 32-node target pass costs < 2 single-token passes, while each
# extra level costs a whole draft pass (docs/cpu-kernels-and-quantization.md, "What this hardware rewards").
DEFAULT_TREE_WIDTHS = [4, 2, 1, 1]


@register_speculation
@dataclass
class TreeConfig(StaticShapeConfig):
    """A static tree: give `widths` (children of every node, per level) or an explicit `parents` list.

    With neither (and `per_step`, the default), the default shape is sized every step: each step drafts the smaller
    version of it (fewer levels, fewer children) with the least predicted time per token, down to a plain step, with
    the latency curves and acceptance vector of the pair's plan (plan/shape_sizing.py). A shape given, or
    `per_step=False`, is drafted as given, every step.
    """

    method = "tree"
    widths: list[int] | None = field(
        default=None,
        metadata={"help": f"Children of every node at each level, e.g. [4, 2, 1]. Default {DEFAULT_TREE_WIDTHS}."},
    )
    parents: list[int] | None = field(
        default=None,
        metadata={"help": "Explicit shape: parents[i] is node i's parent, -1 for the root, breadth-first order."},
    )

    per_step: bool = field(
        default=True,
        metadata={"help": "With no shape given: size the default shape every step (default); False drafts it whole "
                  "every step. A shape given is always drafted as given."},
    )
    plan: Any = set_by_with_plan(
        None, "the pair's plan whose acceptance and latency curves size the default shape every step; None drafts the "
        "shape whole."
    )

    def _sized(self) -> bool:
        return self.per_step and self.widths is None and self.parents is None

    def plan_request(self) -> PlanRequest | None:
        return PlanRequest(max_budget=PLAN_BUDGET) if self._sized() else None

    def with_plan(self, plan: Any, source: str) -> TreeConfig:
        resolved = dataclasses.replace(self)
        if getattr(plan, "profile", None) is not None:
            resolved.plan = plan
            resolved.plan_source = f"the default shape sized every step with the acceptance and latency of {source}"
        return resolved

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> ModelTreeDrafter:
        plan = self.plan
        if plan is None:
            return super().make_drafter(target, assistant_model, logits_processor, child_selection, generator)
        return self.sized_drafter(plan, target, assistant_model,
                                  logits_processor, child_selection, generator)

    def shape_menu(self) -> ShapeMenu:
        """A shape given by its widths (or the default one): its smaller versions, fewer levels and fewer children,
        as a single sequence sizes the default shape; an explicit `parents` list: its level cuts."""
        if self.parents is not None:
            return super().shape_menu()
        return sub_shapes_menu(list(self.widths or DEFAULT_TREE_WIDTHS))

    def validate(self) -> None:
        if self.widths is not None and self.parents is not None:
            raise ValueError("Give a tree either `widths` or `parents`, not both.")
        if self.widths is not None and (not self.widths or any(int(w) < 1 for w in self.widths)):
            raise ValueError(f"Tree widths must be positive integers, one per level, got {self.widths!r}.")
        if self.parents is not None:
            validate_parents(list(self.parents))

    def shape(self) -> list[int]:
        if self.parents is not None:
            return list(self.parents)
        return widths_parents(list(self.widths or DEFAULT_TREE_WIDTHS))
