"""`speculation="sequoia"`: the DP-optimal tree for this pair's measured acceptance, sized to this hardware."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.utils import logging

from ...calibration.plan_file import SequoiaPlan
from ...core.config import PlanRequest, register_speculation
from ...drafting.shaped_tree import StaticShapeConfig
from ...planning.sequoia import TreePlan

logger = logging.get_logger(__name__)


@register_speculation
@dataclass
class SequoiaConfig(StaticShapeConfig):
    """`speculation="sequoia"`: the DP-optimal tree for this pair's measured acceptance, sized to this hardware.

    The plan comes from, in this order: `plan` when given; a plan stored for this model pair, dtype, device and
    temperature (saved on this machine, or shipped with the package for the embedded default pair); else a short
    online calibration on the current prompt, saved for next time. `speculation_stats.plan_source` says which.
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
        resolved.plan_source = source
        logger.info(f"hf_specdec: speculation='sequoia' uses {source}.")
        return resolved

    def shape(self) -> list[int]:
        if not isinstance(self.plan, (TreePlan, SequoiaPlan)):
            raise RuntimeError("SequoiaConfig.shape() needs a plan: the integration looks one up (`plan_request`) "
                               "and passes it to `with_plan` first.")
        return list(self.plan.parents)
