"""`speculation="sequoia"`: the DP-optimal tree for this pair's measured acceptance, sized to this hardware."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.utils import logging

from ...core.config import PlanRequest, register_speculation, set_by_with_plan
from ...draft.shaped_tree import ModelTreeDrafter
from ...plan.shape_sizing import ShapeMenu
from ..static_shape import StaticShapeConfig
from .dp import TreePlan
from .plan_file import SequoiaPlan
from .sizing import sequoia_menu

logger = logging.get_logger(__name__)


@register_speculation
@dataclass
class SequoiaConfig(StaticShapeConfig):
    """`speculation="sequoia"`: the DP-optimal tree for this pair's measured acceptance, sized to this hardware.

    The plan comes from, in this order: `plan` when given; a plan stored for this model pair, dtype, device and
    temperature (saved on this machine, or shipped with the package for the embedded default pair, re-sized with
    latency curves measured here); else a short online calibration on the current prompt, saved for next time.
    `speculation_stats.plan_source` says which.

    A plan looked up (not given) is sized every step (`per_step`, the default): each step drafts the DP's best tree
    for the size and depth with the least predicted time per token, under the acceptance learned while generating
    and latency curves corrected by the passes measured (plan/shape_sizing.py), stops drafting deeper levels when
    the draft is unsure, and runs a plain step (the root alone) when no tree is predicted to beat one. A plan given,
    or `per_step=False`, is drafted as it is, every step.
    """

    method = "sequoia"
    plan: Any = field(
        default=None,
        metadata={"help": "A plan file from `hf-specdec calibrate`, a SequoiaPlan or TreePlan, a dict of either, or "
                  "None to look one up for this pair (then calibrate online)."},
    )
    calibrate_online: bool = field(
        default=True,
        metadata={"help": "When no plan is given or stored, calibrate on the current prompt (a few seconds) and save "
                  "the plan; False raises instead."},
    )
    max_budget: int = field(default=128, metadata={"help": "Largest tree (nodes, root included) online sizing tries."})
    max_depth: int = field(default=12, metadata={"help": "Most levels (root included) online sizing tries."})
    per_step: bool = field(
        default=True,
        metadata={"help": "Size the tree every step from the DP's table (a looked-up plan lends its acceptance and "
                  "latency curves); False drafts the plan's own tree every step. A `plan` given is always kept."},
    )
    sized: bool = set_by_with_plan(
        False, "True when the plan looked up sizes the tree every step (a SequoiaPlan with latency curves, `per_step`, "
        "no `plan` given)."
    )

    def validate(self) -> None:
        if isinstance(self.plan, (str, os.PathLike)) and not Path(self.plan).is_file():
            raise ValueError(
                f"Sequoia plan file {str(self.plan)!r} not found: give the path `hf-specdec calibrate --output` wrote, "
                "or drop `plan` to use a stored plan or calibrate online."
            )
        if self.plan is not None and not isinstance(self.plan, (str, os.PathLike, dict, TreePlan, SequoiaPlan)):
            raise TypeError(f"`plan` must be a path, a dict, a SequoiaPlan or a TreePlan, not {type(self.plan)}.")
        for name in ("max_budget", "max_depth"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")

    def plan_request(self) -> PlanRequest:
        return PlanRequest(self.plan, self.max_budget, self.max_depth, self.calibrate_online)

    def with_plan(self, plan: SequoiaPlan | TreePlan, source: str) -> SequoiaConfig:
        resolved = dataclasses.replace(self, plan=plan)
        resolved.sized = (self.per_step and self.plan is None and isinstance(plan, SequoiaPlan)
                          and plan.profile is not None)
        resolved.plan_source = source  # where the plan came from, as for a static plan (the sizing is logged)
        sizing = "; trees sized every step from its DP table" if resolved.sized else ""
        logger.info(f"hf_specdec: speculation='sequoia' uses {source}{sizing}.")
        return resolved

    def drafts(self) -> bool:
        return self.sized or super().drafts()

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> ModelTreeDrafter:
        if not self.sized:
            return super().make_drafter(target, assistant_model, logits_processor, child_selection, generator)
        return self.sized_drafter(self.plan, target, assistant_model, logits_processor,
                                  child_selection, generator)

    def shape_menu(self) -> ShapeMenu:
        """A plan looked up and sized every step: the DP's best tree for every size and depth, as one sequence sizes
        it; a plan drafted as it is: its level cuts."""
        if not self.sized:
            return super().shape_menu()
        return sequoia_menu(self.plan.acceptance, self.max_budget, self.max_depth)

    def shape(self) -> list[int]:
        if not isinstance(self.plan, (TreePlan, SequoiaPlan)):
            raise RuntimeError("SequoiaConfig.shape() needs a plan: the integration looks one up (`plan_request`) "
                               "and passes it to `with_plan` first.")
        return list(self.plan.parents)
