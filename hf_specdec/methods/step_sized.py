"""What `specexec` and `staged` share when their `budget` is left out: trees sized every step by a cost model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from transformers import LogitsProcessorList, PreTrainedModel

from ..core.config import ModelDraftConfig, PlanRequest, set_by_with_plan
from ..plan.step_sizing import StepSizer, learned_acceptance, processors_key

#: the largest tree a plan made for a step-sized method may have (the plan lends only its latency curves)
PLAN_BUDGET = 128


@dataclass
class StepSizedConfig(ModelDraftConfig):
    """A best-first method whose `budget=None` means: size the tree every step (plan/step_sizing.py).

    The sizing needs this pair's latency curves on this hardware: `plan_request` asks the integration for them
    (stored, re-sized, or measured at first use) and `with_plan` keeps them in `profile` (and the plan's acceptance
    vector in `acceptance`, to price a batch call: `integration.batch.BatchCall.drafts`). A subclass declares the
    settings `budget: int | None` (None: sized every step) and `max_depth: int`.
    """

    profile: Any = set_by_with_plan(
        None, "the latency curves (`HardwareProfile`) trees are sized with every step; None with a fixed budget."
    )
    acceptance: Any = set_by_with_plan(
        None, "the plan's calibrated acceptance vector: what a batch call is priced with before its rows draft."
    )

    def plan_request(self) -> PlanRequest | None:
        return None if self.budget is not None else PlanRequest(max_budget=PLAN_BUDGET, max_depth=self.max_depth + 1)

    def with_plan(self, plan: Any, source: str) -> StepSizedConfig:
        resolved = dataclasses.replace(self)
        resolved.profile, resolved.acceptance = plan.profile, list(plan.acceptance)
        resolved.plan_source = f"trees sized every step with the latency curves of {source}"
        return resolved

    def make_sizer(
        self, target: PreTrainedModel, draft: PreTrainedModel, processors: LogitsProcessorList | None
    ) -> StepSizer | None:
        """The cost model for this call (None with a fixed budget); what it learns carries over to the next call."""
        if self.budget is not None:
            return None
        profile = self.profile
        if profile is None:
            raise RuntimeError(f"{type(self).__name__} without a budget needs latency curves: the integration passes "
                               "a plan to `with_plan` first (see `plan_request`).")
        return online_sizer(profile, target, draft, processors)


def online_sizer(
    profile: Any, target: PreTrainedModel, draft: PreTrainedModel, processors: LogitsProcessorList | None
) -> StepSizer:
    """A call's cost model: these latency curves, and the acceptance learned so far for this pair and processors."""
    return StepSizer(profile, learned_acceptance(draft, (id(target), processors_key(processors))))
