"""Find the plan a generate call should use, saying where it came from: given, stored, re-sized or calibrated now.

Shared by `speculation="sequoia"` (the tree is the plan) and `speculation="specexec"` (the plan's acceptance vector
and latency curves choose the budget).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
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
    """(plan, where it came from). In order: `request.given` (a path, dict, SequoiaPlan or TreePlan); a stored plan
    for this pair, temperature and hardware; a stored plan of another hardware, re-sized with latency curves measured
    here; else a short calibration on the current prompt. Anything made here is saved for the next call (or kept in
    memory where the plan folder cannot be written), under a lock so that processes sharing the folder make it once.

    On a target sharded over `ranks`, the deciding rank looks the plan up, saves it and hands it (or its error) to
    the others; they run the same target passes meanwhile (the route it announces: re-sizing's latency curves or
    the whole online calibration), which a sharded target needs every rank for."""
    if request.given is not None:
        return given_plan(request.given)
    if not ranks.deciding:
        route = ranks.decided(None)
        if route == _MEASURE:
            _measure(target, draft, ranks)
        elif route == _CALIBRATE:
            _calibrate_online(request, target, draft, temperature, input_ids, ranks)
        return _raised_or(ranks.decided(None))
    announced: list[str] = []

    def announce(route: str) -> None:
        announced.append(route)
        ranks.decided(route)

    try:
        found: tuple | BaseException = _plan_here(request, target, draft, temperature, input_ids, ranks, announce)
    except Exception as exc:  # handed to the other ranks too, so that none waits for a plan that never comes
        found = exc
    if not announced:
        ranks.decided(_NO_PASSES)
    return _raised_or(ranks.decided(found))


# what the deciding rank's lookup runs, announced so that the other ranks run the same target passes
_NO_PASSES, _MEASURE, _CALIBRATE = "no target passes", "latency curves", "online calibration"


def _raised_or(found: tuple | BaseException) -> tuple:
    if isinstance(found, BaseException):
        raise found
    return found


def _plan_here(
    request: PlanRequest, target: PreTrainedModel, draft: PreTrainedModel, temperature: float,
    input_ids: torch.LongTensor, ranks: Ranks, announce: Callable[[str], None],
) -> tuple[SequoiaPlan, str]:
    """The lookup itself (stored, re-sized or calibrated), on the deciding rank; `announce` is told which target
    passes it runs before it runs them."""
    ready = _ready_plan(target, draft, temperature)
    if ready is not None:
        return ready
    if not request.calibrate_online and store.find_plan(target, draft, temperature) is None:
        raise ValueError(
            f"No Sequoia plan for this model pair at temperature {temperature:g}: run `hf-specdec calibrate "
            "--target ... --draft ... --save`, pass speculation_config={'plan': <file>}, or allow calibrate_online."
        )
    with store.plan_lock():
        # another process may have made the plan while this one waited for the lock
        return (_ready_plan(target, draft, temperature)
                or _made_plan(request, target, draft, temperature, input_ids, ranks, announce))


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


def _ready_plan(target: PreTrainedModel, draft: PreTrainedModel, temperature: float
                ) -> tuple[SequoiaPlan, str] | None:
    """A stored plan for this pair and temperature measured on this hardware, if any."""
    found = store.find_plan(target, draft, temperature)
    if found is None or not found[0].runs_here(target, draft):
        return None
    return found[0], store.describe(found[1])


def _made_plan(
    request: PlanRequest, target: PreTrainedModel, draft: PreTrainedModel, temperature: float,
    input_ids: torch.LongTensor, ranks: Ranks, announce: Callable[[str], None],
) -> tuple[SequoiaPlan, str]:
    """A plan made now: a stored one of other hardware re-sized here, else calibrated on this prompt; saved."""
    found = store.find_plan(target, draft, temperature)
    if found is not None:
        plan, path = found
        profile, how = store.find_profile(target, draft), "latency curves saved for this hardware"
        if profile is None:
            announce(_MEASURE)
            start = time.perf_counter()
            profile = _measure(target, draft, ranks)
            how = f"latency measured now ({time.perf_counter() - start:.1f} s)"
        plan = resize(plan, profile, request.max_budget, request.max_depth, source="re-sized for this hardware")
        return plan, f"acceptance from {store.describe(path)}, {how}, re-sized and {_saved(plan, target, draft)}"
    announce(_CALIBRATE)
    plan = _calibrate_online(request, target, draft, temperature, input_ids, ranks)
    seconds = plan.environment.get("calibration_seconds", 0.0)
    source = f"online calibration on this prompt ({seconds:.1f} s), {_saved(plan, target, draft)}"
    logger.warning(
        f"hf_specdec: no Sequoia plan for this model pair at temperature {temperature:g}; {source}. "
        "`hf-specdec calibrate` on representative prompts makes a better one."
    )
    return plan, source


def _measure(target: PreTrainedModel, draft: PreTrainedModel, ranks: Ranks) -> HardwareProfile:
    """Latency curves for re-sizing. Timing an offloaded target's big trees takes minutes: show a bar then, stay
    quiet otherwise. A sharded target is timed at every size, so that every rank runs the same passes."""
    return measure_profile(target, draft, online_sizes(target), repeats=1, progress=is_offloaded(target),
                           target_stop_ratio=None if ranks.shared else STOP_RATIO)


def _calibrate_online(
    request: PlanRequest, target: PreTrainedModel, draft: PreTrainedModel, temperature: float,
    input_ids: torch.LongTensor, ranks: Ranks,
) -> SequoiaPlan:
    """The short calibration on this prompt (its target passes are the same on every rank of a sharded target)."""
    return calibrate(target, draft, [input_ids[0]], temperature=temperature, width=8, max_new_tokens=32,
                     max_budget=request.max_budget, max_depth=request.max_depth, latency_sizes=online_sizes(target),
                     online=True, progress=is_offloaded(target),
                     target_stop_ratio=None if ranks.shared else STOP_RATIO)


def _saved(plan: SequoiaPlan, target: PreTrainedModel, draft: PreTrainedModel) -> str:
    """Save `plan` and say where (or that it is kept in memory: see `store.save_user_plan`)."""
    path = store.save_user_plan(plan, target, draft)
    return f"saved to {path}" if path is not None else "kept in memory (the plan folder cannot be written)"
