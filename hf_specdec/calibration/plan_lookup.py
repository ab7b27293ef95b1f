"""Find the plan a generate call should use, saying where it came from: given, stored, re-sized or calibrated now.

Shared by `speculation="sequoia"` (the tree is the plan) and `speculation="specexec"` (the plan's acceptance vector
and latency curves choose the budget).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import logging

from ..core.config import PlanRequest
from ..core.devices import is_offloaded
from ..planning.sequoia import TreePlan
from . import store
from .calibrate import calibrate, measure_profile, resize
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
) -> tuple[SequoiaPlan | TreePlan, str]:
    """(plan, where it came from). In order: `request.given` (a path, dict, SequoiaPlan or TreePlan); a stored plan
    for this pair, temperature and hardware; a stored plan of another hardware, re-sized with latency curves measured
    here; else a short calibration on the current prompt. Anything made here is saved for the next call (or kept in
    memory where the plan folder cannot be written), under a lock so that processes sharing the folder make it once."""
    if request.given is not None:
        return given_plan(request.given)
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
        return _ready_plan(target, draft, temperature) or _made_plan(request, target, draft, temperature, input_ids)


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
    input_ids: torch.LongTensor,
) -> tuple[SequoiaPlan, str]:
    """A plan made now: a stored one of other hardware re-sized here, else calibrated on this prompt; saved."""
    found = store.find_plan(target, draft, temperature)
    if found is not None:
        plan, path = found
        profile, how = store.find_profile(target, draft), "latency curves saved for this hardware"
        if profile is None:
            start = time.perf_counter()
            # timing an offloaded target's big trees takes minutes: show a bar then, stay quiet otherwise
            profile = measure_profile(target, draft, online_sizes(target), repeats=1, progress=is_offloaded(target))
            how = f"latency measured now ({time.perf_counter() - start:.1f} s)"
        plan = resize(plan, profile, request.max_budget, request.max_depth, source="re-sized for this hardware")
        return plan, f"acceptance from {store.describe(path)}, {how}, re-sized and {_saved(plan, target, draft)}"
    plan = calibrate(target, draft, [input_ids[0]], temperature=temperature, width=8, max_new_tokens=32,
                     max_budget=request.max_budget, max_depth=request.max_depth, latency_sizes=online_sizes(target),
                     online=True, progress=is_offloaded(target))
    seconds = plan.environment.get("calibration_seconds", 0.0)
    source = f"online calibration on this prompt ({seconds:.1f} s), {_saved(plan, target, draft)}"
    logger.warning(
        f"hf_specdec: no Sequoia plan for this model pair at temperature {temperature:g}; {source}. "
        "`hf-specdec calibrate` on representative prompts makes a better one."
    )
    return plan, source


def _saved(plan: SequoiaPlan, target: PreTrainedModel, draft: PreTrainedModel) -> str:
    """Save `plan` and say where (or that it is kept in memory: see `store.save_user_plan`)."""
    path = store.save_user_plan(plan, target, draft)
    return f"saved to {path}" if path is not None else "kept in memory (the plan folder cannot be written)"
