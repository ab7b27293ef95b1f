"""Find the plan a generate call should use, saying where it came from: given, stored, re-sized or calibrated now.

One object (`PlanLookup`) answers it for a call, before the loop. Sequoia drafts the plan's tree (or sizes it every
step from the plan's acceptance vector); `tree`, `specexec` and `staged` borrow the plan's latency curves to size
their trees, and a batch drafting a fixed shape its curves and acceptance.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import logging

from ...core.config import PlanRequest
from ...plan.latency import STOP_RATIO
from ...plan.sizing import HardwareProfile
from ...runtime.devices import is_offloaded
from ...runtime.ranks import ONE_PROCESS, Ranks
from . import store
from .calibrate import calibrate, measure_profile, resize
from .dp import TreePlan
from .plan_file import INVALID_VALUE, SequoiaPlan

logger = logging.get_logger(__name__)

# Tree sizes timed when a plan is made or re-sized inside a generate call: few, so it takes seconds. An offloaded
# target pays its weight transfer on every pass, so its curve is flat far further out: time larger trees.
ONLINE_SIZES = (1, 4, 8, 16, 32, 64, 128)
OFFLOADED_SIZES = (1, 16, 64, 256, 1024, 2048)


def call_temperature(generation_config: GenerationConfig) -> float:
    """0 for greedy decoding, else the sampling temperature (what acceptance depends on)."""
    return float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0


def online_sizes(target: PreTrainedModel) -> tuple[int, ...]:
    return OFFLOADED_SIZES if is_offloaded(target) else ONLINE_SIZES


def plan_for_call(
    request: PlanRequest,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    temperature: float,
    input_ids: torch.LongTensor,
    ranks: Ranks = ONE_PROCESS,
) -> tuple[SequoiaPlan | TreePlan, str]:
    """(plan, where it came from): `PlanLookup(...).find()`."""
    return PlanLookup(request, target, draft, temperature, input_ids, ranks).find()


# what the deciding rank's lookup runs, announced so that the other ranks run the same target passes
_NO_PASSES, _MEASURE, _CALIBRATE = "no target passes", "latency curves", "online calibration"


class PlanLookup:
    """The plan of one call for this pair at this temperature: given, stored, re-sized or calibrated on `input_ids`.

    `find` looks in this order: `request.given` (a path, dict, SequoiaPlan or TreePlan); a stored plan for this pair,
    temperature and hardware; a stored plan of another hardware, re-sized with latency curves measured here; else a
    short calibration on the current prompt. Anything made here is saved for the next call (or kept in memory where
    the plan folder cannot be written), under a lock so that processes sharing the folder make it once.

    On a target sharded over `ranks`, the deciding rank looks the plan up, saves it and hands it (or its error) to
    the others; they run the same target passes meanwhile (the route it announces: re-sizing's latency curves or
    the whole online calibration), which a sharded target needs every rank for."""

    def __init__(self, request: PlanRequest, target: PreTrainedModel, draft: PreTrainedModel, temperature: float,
                 input_ids: torch.LongTensor, ranks: Ranks = ONE_PROCESS) -> None:
        self.request, self.target, self.draft, self.temperature = request, target, draft, temperature
        self.input_ids, self.ranks = input_ids, ranks
        self.announced: list[str] = []

    def find(self) -> tuple[SequoiaPlan | TreePlan, str]:
        """(plan, where it came from)."""
        if self.request.given is not None:
            return given_plan(self.request.given)
        if not self.ranks.deciding:  # run the target passes the deciding rank announces, then take its plan
            route = self.ranks.decided(None)
            if route == _MEASURE:
                self._measure()
            elif route == _CALIBRATE:
                self._calibrate_online()
            return _raised_or(self.ranks.decided(None))
        try:
            found: tuple | BaseException = self._plan_here()
        except Exception as exc:  # handed to the other ranks too, so that none waits for a plan that never comes
            found = exc
        if not self.announced:
            self.ranks.decided(_NO_PASSES)
        return _raised_or(self.ranks.decided(found))

    def _announce(self, route: str) -> None:
        """Tell the other ranks which target passes this rank is about to run."""
        self.announced.append(route)
        self.ranks.decided(route)

    def _plan_here(self) -> tuple[SequoiaPlan, str]:
        """The lookup itself (stored, re-sized or calibrated), on the deciding rank."""
        ready = self._ready_plan()
        if ready is not None:
            return ready
        if not self.request.calibrate_online and store.find_plan(self.target, self.draft, self.temperature) is None:
            raise ValueError(
                f"No Sequoia plan for this model pair at temperature {self.temperature:g}: run `hf-specdec calibrate "
                "--target ... --draft ... --save`, pass speculation_config={'plan': <file>}, or allow "
                "calibrate_online."
            )
        with store.plan_lock():
            # another process may have made the plan while this one waited for the lock
            return self._ready_plan() or self._made_plan()

    def _ready_plan(self) -> tuple[SequoiaPlan, str] | None:
        """A stored plan for this pair and temperature measured on this hardware, if any."""
        found = store.find_plan(self.target, self.draft, self.temperature)
        if found is None or not found[0].runs_here(self.target, self.draft):
            return None
        return found[0], store.describe(found[1])

    def _made_plan(self) -> tuple[SequoiaPlan, str]:
        """A plan made now: a stored one of other hardware re-sized here, else calibrated on this prompt; saved."""
        found = store.find_plan(self.target, self.draft, self.temperature)
        if found is not None:
            plan, path = found
            profile, how = store.find_profile(self.target, self.draft), "latency curves saved for this hardware"
            if profile is None:
                self._announce(_MEASURE)
                start = time.perf_counter()
                profile = self._measure()
                how = f"latency measured now ({time.perf_counter() - start:.1f} s)"
            plan = resize(plan, profile, self.request.max_budget, self.request.max_depth,
                          source="re-sized for this hardware")
            return plan, f"acceptance from {store.describe(path)}, {how}, re-sized and {self._saved(plan)}"
        self._announce(_CALIBRATE)
        plan = self._calibrate_online()
        seconds = plan.environment.get("calibration_seconds", 0.0)
        source = f"online calibration on this prompt ({seconds:.1f} s), {self._saved(plan)}"
        logger.warning(
            f"hf_specdec: no Sequoia plan for this model pair at temperature {self.temperature:g}; {source}. "
            "`hf-specdec calibrate` on representative prompts makes a better one."
        )
        return plan, source

    def _measure(self) -> HardwareProfile:
        """Latency curves for re-sizing. Timing an offloaded target's big trees takes minutes: show a bar then, stay
        quiet otherwise. A sharded target is timed at every size, so that every rank runs the same passes."""
        return measure_profile(self.target, self.draft, online_sizes(self.target), repeats=1,
                               progress=is_offloaded(self.target),
                               target_stop_ratio=None if self.ranks.shared else STOP_RATIO)

    def _calibrate_online(self) -> SequoiaPlan:
        """The short calibration on this prompt (its target passes are the same on every rank of a sharded
        target)."""
        return calibrate(self.target, self.draft, [self.input_ids[0]], temperature=self.temperature, width=8,
                         max_new_tokens=32, max_budget=self.request.max_budget, max_depth=self.request.max_depth,
                         latency_sizes=online_sizes(self.target), online=True, progress=is_offloaded(self.target),
                         target_stop_ratio=None if self.ranks.shared else STOP_RATIO)

    def _saved(self, plan: SequoiaPlan) -> str:
        """Save `plan` and say where (or that it is kept in memory: see `store.save_user_plan`)."""
        path = store.save_user_plan(plan, self.target, self.draft)
        return f"saved to {path}" if path is not None else "kept in memory (the plan folder cannot be written)"


def _raised_or(found: tuple | BaseException) -> tuple:
    if isinstance(found, BaseException):
        raise found
    return found


def given_plan(given: Any) -> tuple[SequoiaPlan | TreePlan, str]:
    """The plan passed in the call (a path, dict, SequoiaPlan or TreePlan), checked like a stored one."""
    if isinstance(given, (str, os.PathLike)):
        return SequoiaPlan.load(given), f"plan file {given}"
    try:
        if isinstance(given, dict):
            return (SequoiaPlan.from_dict if "tree" in given else TreePlan.from_dict)(given), "the plan given"
        (given.tree if isinstance(given, SequoiaPlan) else given).check_limits()
        if isinstance(given, SequoiaPlan):
            given.check_values()
    except INVALID_VALUE as exc:
        raise ValueError(f"The plan given is not a valid plan ({exc}): pass a plan `hf-specdec calibrate` "
                         "wrote, or its `to_dict()`.") from exc
    return given, "the plan given"
