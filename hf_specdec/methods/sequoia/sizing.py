"""Sequoia's hardware-aware size: the (budget, depth) whose DP-optimal tree gives the least predicted time per token,

    seconds per token = (sum over levels t_draft(w_level) + t_target(n) + overhead) / E[n, d]

with E from the DP (`dp.py`) for the measured acceptance vector and t from the measured latency curves
(`plan.sizing.step_seconds`). `choose_plan` sizes a calibrated plan once; `sequoia_menu` lists the DP's tree for every
(size, depth) so that a call can choose among them every step (`plan.shape_sizing.ShapeChooser`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...plan.shape_sizing import ShapeMenu
from ...plan.sizing import HardwareProfile, step_seconds
from .dp import TreePlan, TreePlanner


def default_budgets(max_budget: int) -> list[int]:
    """Every size up to 16, then steps of 4 up to 64, then of 16: fine where the choice is delicate."""
    sizes = list(range(1, min(max_budget, 16) + 1)) + list(range(20, min(max_budget, 64) + 1, 4))
    sizes += list(range(80, max_budget + 1, 16))
    return sorted({s for s in sizes if s <= max_budget} | {max_budget})


@dataclass(frozen=True)
class SizedPlan:
    """The chosen tree, its predictions, and every candidate considered (for plots and reports)."""

    plan: TreePlan
    seconds_per_step: float
    candidates: list[dict] = field(default_factory=list)

    @property
    def seconds_per_token(self) -> float:
        return self.seconds_per_step / self.plan.expected_tokens


def choose_plan(
    acceptance: Sequence[float],
    profile: HardwareProfile,
    max_budget: int = 128,
    max_depth: int = 12,
    budgets: Sequence[int] | None = None,
) -> SizedPlan:
    """The optimal tree over budgets <= `max_budget` and depths <= `max_depth` minimising predicted time per token."""
    planner = TreePlanner(acceptance, max_budget, max_depth)
    best: tuple[float, TreePlan, float] | None = None
    candidates = []
    for depth in range(1, max_depth + 1):
        for budget in budgets or default_budgets(max_budget):
            plan = planner.plan(budget, depth)
            seconds = step_seconds(plan.parents, profile)
            per_token = seconds / plan.expected_tokens
            candidates.append({
                "budget": budget, "max_depth": depth, "nodes": len(plan.parents),
                "expected_tokens": plan.expected_tokens, "seconds_per_step": seconds, "seconds_per_token": per_token,
            })
            if best is None or per_token < best[0] - 1e-12:
                best = (per_token, plan, seconds)
    return SizedPlan(best[1], best[2], candidates)


@functools.lru_cache(maxsize=8)
def _dp_shapes(acceptance: tuple[float, ...], max_budget: int, max_depth: int) -> tuple[tuple[int, ...], ...]:
    planner = TreePlanner(acceptance, max_budget, max_depth)
    return tuple(tuple(planner.plan(budget, depth).parents)
                 for depth in range(1, max_depth + 1) for budget in default_budgets(max_budget))


def sequoia_menu(acceptance: Sequence[float], max_budget: int, max_depth: int) -> ShapeMenu:
    """The DP's best tree for every (size, depth) the hardware-aware sizing compares (planned once per vector, and
    the menu kept for the calls after: building it costs ~0.1 s of host time, ten steps' worth on a GPU)."""
    return _sequoia_menu(tuple(float(p) for p in acceptance), int(max_budget), int(max_depth))


@functools.lru_cache(maxsize=8)
def _sequoia_menu(acceptance: tuple[float, ...], max_budget: int, max_depth: int) -> ShapeMenu:
    return ShapeMenu.of(_dp_shapes(acceptance, max_budget, max_depth))
