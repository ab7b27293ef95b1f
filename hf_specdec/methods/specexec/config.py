"""`speculation="specexec"`: best-first trees of the draft's most probable continuations (SpecExec)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...core.config import PlanRequest, SpeculationConfig, register_speculation
from ...core.model_info import vocab_size
from ...drafting.best_first import BestFirstDrafter
from ...planning.sizing import choose_budget, default_beams

BUDGETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@register_speculation
@dataclass
class SpecExecConfig(SpeculationConfig):
    """`speculation="specexec"`: best-first trees of the draft's most probable continuations (SpecExec).

    Without a `budget`, the budget is chosen from this pair's measured latency curves and acceptance vector (the
    plan store shared with `speculation="sequoia"`: stored, re-sized for this hardware, or calibrated at first use):
    a few dozen nodes for a target in memory, hundreds when accelerate offloads it and every pass costs the same.
    """

    method = "specexec"
    budget: int | None = field(
        default=None,
        metadata={"help": "Tree size incl. the root (2 to 4096). Default: chosen from the measured latency curve."},
    )
    max_depth: int = field(default=12, metadata={"help": "Deepest drafted token (levels below the root)."})
    width: int = field(default=8, metadata={"help": "Children considered per expanded node."})
    beams: int | None = field(default=None, metadata={"help": "Nodes expanded per draft pass (default budget/8)."})
    max_budget: int = field(default=2048, metadata={"help": "Largest budget the automatic choice considers."})

    def validate(self) -> None:
        if self.budget is not None and not 2 <= int(self.budget) <= 4096:
            raise ValueError(f"budget must be between 2 and 4096 tokens, got {self.budget!r}.")
        for name in ("max_depth", "width", "max_budget") + (("beams",) if self.beams is not None else ()):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}.")

    def plan_request(self) -> PlanRequest | None:
        """Without a budget: the pair's acceptance vector and latency curves, to choose one."""
        return None if self.budget is not None else PlanRequest(max_budget=128, max_depth=self.max_depth + 1)

    def with_plan(self, plan: Any, source: str) -> SpecExecConfig:
        budgets = [b for b in BUDGETS if b <= self.max_budget]
        budget, _ = choose_budget(plan.acceptance, plan.profile, budgets, self.max_depth,
                                  beams_for=lambda b: self.beams or default_beams(b))
        resolved = dataclasses.replace(self, budget=budget)
        resolved.plan_source = f"budget {budget} chosen from the latency curves and acceptance of {source}"
        return resolved

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> BestFirstDrafter:
        if self.budget is None:
            raise RuntimeError("SpecExecConfig.make_drafter needs a budget: the integration passes a plan to "
                               "`with_plan` first (see `plan_request`).")
        return BestFirstDrafter(assistant_model, int(self.budget), self.max_depth, self.width, self.beams,
                                logits_processor, vocab=vocab_size(target))
