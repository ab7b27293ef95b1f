"""Measured latency: a pair's forward-time curves on one device (`HardwareProfile`), a static shape's predicted step
time, and the curves as a batch's rows see them. A step costs one draft pass per tree level that has children (a level
of w such nodes is one pass over w tokens; the root's pass also feeds the previous step's last tokens) plus one target
pass over the whole tree (`step_seconds`). Sizing a tree against these is each method's: Sequoia's DP over (budget,
depth) in `methods/sequoia/sizing.py`, per-step sizing in `step_sizing.py` and `shape_sizing.py`."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..runtime.paths import json_object
from .latency import LatencyCurve

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


def for_batch(profile: HardwareProfile, rows: int, measured_only: bool = False) -> HardwareProfile:
    """`profile` as a batch of `rows` sequences sees it: a pass over n nodes per row is a pass over rows * n tokens,
    for the target and for a draft that drafts every row in lockstep; `choose_plan` on it sizes one row's tree.
    `measured_only`: only the sizes whose rows * n tokens the curves measured are kept (n = 1 at least), so that a
    step sizer grows no row's tree past them (`StepSizer.max_nodes`, as `row_share` does)."""
    return HardwareProfile(_rescaled(profile.target, rows, measured_only=measured_only),
                           _rescaled(profile.draft, rows, measured_only=measured_only), dict(profile.placement),
                           profile.step_overhead)


def row_by_row(profile: HardwareProfile, rows: int) -> HardwareProfile:
    """`profile` as a batch of `rows` sequences sees it where every row drafts its own tree, one row after another
    (specexec, staged: a drafter per row), and one target pass verifies every row's nodes: a draft pass over n nodes
    per row is `rows` passes over n tokens, the target's a pass over rows * n tokens."""
    return HardwareProfile(_rescaled(profile.target, rows), _rescaled(profile.draft, 1, times=rows),
                           dict(profile.placement), profile.step_overhead)


def _rescaled(curve: LatencyCurve, rows: int, times: int = 1, measured_only: bool = False) -> LatencyCurve:
    """`curve` over n tokens per row of `rows` rows: `times` its time over rows * n tokens (`measured_only`: at the
    sizes whose rows * n tokens it measured, at least n = 1)."""
    sizes = curve.sizes
    if measured_only:
        sizes = tuple(size for size in sizes if rows * size <= curve.sizes[-1]) or (1,)
    return LatencyCurve(sizes, tuple(times * float(curve(rows * size)) for size in sizes), curve.past_length)


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
