"""Find the plan a generate call should use, saying where it came from: given, stored, re-sized or calibrated now.

Shared by `speculation="sequoia"` (the tree is the plan) and `speculation="specexec"` (the plan's acceptance vector
and latency curves choose the budget).
"""

from __future__ import annotations

import os
import time

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import logging

from ..core.config import PlanRequest
from ..core.devices import is_offloaded
from ..planning.sequoia import TreePlan
from . import store
from .calibrate import calibrate, measure_profile, resize
from .plan_file import SequoiaPlan

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
    here; else a short calibration on the current prompt. Anything made here is saved for the next call."""
    given, max_budget, max_depth = request.given, request.max_budget, request.max_depth
    if isinstance(given, (str, os.PathLike)):
        return SequoiaPlan.load(given), f"plan file {given}"
    if isinstance(given, dict):
        return (SequoiaPlan.from_dict(given) if "tree" in given else TreePlan.from_dict(given)), "the plan given"
    if given is not None:
        return given, "the plan given"
    found = store.find_plan(target, draft, temperature)
    if found is not None:
        plan, path = found
        origin = f"{'shipped' if store.is_shipped(path) else 'saved'} plan {path.name}"
        if plan.runs_here(target, draft):
            return plan, origin
        profile, how = store.find_profile(target, draft), "latency curves saved for this hardware"
        if profile is None:
            start = time.perf_counter()
            # timing an offloaded target's big trees takes minutes: show a bar then, stay quiet otherwise
            profile = measure_profile(target, draft, online_sizes(target), repeats=1, progress=is_offloaded(target))
            how = f"latency measured now ({time.perf_counter() - start:.1f} s)"
        plan = resize(plan, profile, max_budget, max_depth, source="re-sized for this hardware")
        path = store.save_user_plan(plan, target, draft)
        return plan, f"acceptance from {origin}, {how}, re-sized and saved to {path}"
    if not request.calibrate_online:
        raise ValueError(
            f"No Sequoia plan for this model pair at temperature {temperature:g}: run `hf-specdec calibrate "
            "--target ... --draft ... --save`, pass speculation_config={'plan': <file>}, or allow calibrate_online."
        )
    plan = calibrate(target, draft, [input_ids[0]], temperature=temperature, width=8, max_new_tokens=32,
                     max_budget=max_budget, max_depth=max_depth, latency_sizes=online_sizes(target), online=True,
                     progress=is_offloaded(target))
    path = store.save_user_plan(plan, target, draft)
    seconds = plan.environment.get("calibration_seconds", 0.0)
    source = f"online calibration on this prompt ({seconds:.1f} s), saved to {path}"
    logger.warning(
        f"hf_specdec: no Sequoia plan for this model pair at temperature {temperature:g}; {source}. "
        "`hf-specdec calibrate` on representative prompts makes a better one."
    )
    return plan, source
