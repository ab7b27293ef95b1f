"""Hardware-aware tree size: the (budget, depth) whose optimal tree gives the least predicted time per token.

A step costs one draft pass per tree level that has children (a level of w such nodes is one pass over w
tokens; the root's pass also feeds the previous step's last tokens) plus one target pass over the whole tree:

    seconds per token = (sum over levels t_draft(w_level) + t_target(n) + overhead) / E[n, d]

with E from the Sequoia DP for the measured acceptance vector and t from measured latency curves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..runtime.paths import json_object
from .latency import LatencyCurve
from .sequoia import TreePlan, TreePlanner

# The root's draft pass re-feeds the last accepted token and the bonus token.
ROOT_PASS_TOKENS = 2


@dataclass(frozen=True)
class HardwareProfile:
    """Measured forward-time curves of a target/draft pair on one device, plus a fixed per-step overhead.

    `placement` says where they were measured (see `latency.placement`): a profile is only valid there.
    """

    target: LatencyCurve
    draft: LatencyCurve
    placement: dict = field(default_factory=dict)
    step_overhead: float = 0.0  # seconds of engine bookkeeping per step

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_overhead) and self.step_overhead >= 0):
            raise ValueError(f"step_overhead must be finite seconds >= 0, got {self.step_overhead!r}.")

    @property
    def dtype(self) -> str:
        return str(self.placement.get("dtype", "?"))

    @property
    def device(self) -> str:
        return str(self.placement.get("device", "?"))

    @property
    def offloaded(self) -> bool:
        return bool(self.placement.get("offloaded", False))

    def to_dict(self) -> dict:
        return {
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict(),
            "placement": dict(self.placement),
            "step_overhead": self.step_overhead,
        }

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        data = json_object(data, "A latency profile")
        return cls(
            LatencyCurve.from_dict(data["target"]),
            LatencyCurve.from_dict(data["draft"]),
            dict(json_object(data.get("placement", {}), "A profile's placement")),
            float(data.get("step_overhead", 0.0)),
        )


def level_widths_with_children(parents: Sequence[int]) -> list[int]:
    """Per level (root first), how many nodes have children: the width of each draft pass."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    with_children = Counter(depths[p] for p in set(parents[1:]))
    return [with_children[level] for level in range(max(with_children, default=-1) + 1)]


def step_seconds(parents: Sequence[int], profile: HardwareProfile) -> float:
    """Predicted seconds of one step drafting and verifying the tree `parents`."""
    widths = level_widths_with_children(parents)
    drafting = sum(profile.draft(ROOT_PASS_TOKENS if level == 0 else w) for level, w in enumerate(widths))
    return drafting + profile.target(len(parents)) + profile.step_overhead


@dataclass(frozen=True)
class SizedPlan:
    """The chosen tree, its predictions, and every candidate considered (for plots and reports)."""

    plan: TreePlan
    seconds_per_step: float
    candidates: list[dict] = field(default_factory=list)

    @property
    def seconds_per_token(self) -> float:
        return self.seconds_per_step / self.plan.expected_tokens


def default_budgets(max_budget: int) -> list[int]:
    """Every size up to 16, then steps of 4 up to 64, then of 16: fine where the choice is delicate."""
    sizes = list(range(1, min(max_budget, 16) + 1)) + list(range(20, min(max_budget, 64) + 1, 4))
    sizes += list(range(80, max_budget + 1, 16))
    return sorted({s for s in sizes if s <= max_budget} | {max_budget})


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


def default_beams(budget: int) -> int:
    """Nodes a best-first drafter expands per draft pass when none is given: an eighth of the budget, at least 4."""
    return max(4, budget // 8)


def for_batch(profile: HardwareProfile, rows: int) -> HardwareProfile:
    """`profile` as a batch of `rows` sequences sees it: a pass over n nodes per row is a pass over rows * n tokens,
    for the target and for a draft that drafts every row in lockstep; `choose_plan` on it sizes one row's tree."""
    return HardwareProfile(_rescaled(profile.target, rows), _rescaled(profile.draft, rows), dict(profile.placement),
                           profile.step_overhead)


def row_by_row(profile: HardwareProfile, rows: int) -> HardwareProfile:
    """`profile` as a batch of `rows` sequences sees it where every row drafts its own tree, one row after another
    (specexec, staged: a drafter per row), and one target pass verifies every row's nodes: a draft pass over n nodes
    per row is `rows` passes over n tokens, the target's a pass over rows * n tokens."""
    return HardwareProfile(_rescaled(profile.target, rows), _rescaled(profile.draft, 1, times=rows),
                           dict(profile.placement), profile.step_overhead)


def _rescaled(curve: LatencyCurve, rows: int, times: int = 1) -> LatencyCurve:
    """`curve` over n tokens per row of `rows` rows: `times` its time over rows * n tokens."""
    return LatencyCurve(curve.sizes, tuple(times * float(curve(rows * size)) for size in curve.sizes),
                        curve.past_length)


def row_share(profile: HardwareProfile, rows: int) -> HardwareProfile:
    """`profile` as one row of a batch of `rows` sees it where every row drafts its own tree (its draft passes its
    own) and one target pass verifies every row's nodes: a pass over n nodes per row is a pass over rows * n
    tokens, of which the row pays a `rows`-th. Only the sizes whose rows * n tokens the target's curve measured
    are kept (n = 1 at least): a step sizer grows no tree past them (`StepSizer.max_nodes`), where the straight
    line beyond a flat GPU curve would price a batch's 2,048-token pass like a 128-token one."""
    target = profile.target
    sizes = tuple(size for size in target.sizes if rows * size <= target.sizes[-1]) or (1,)
    shared = LatencyCurve(sizes, tuple(float(target(rows * size)) / rows for size in sizes), target.past_length)
    return HardwareProfile(shared, profile.draft, dict(profile.placement), profile.step_overhead)
