"""Where Sequoia plans live and how one is found for a model pair.

Two places, searched in this order: plans saved on this machine (`<hf_specdec cache>/plans`, written by
`hf-specdec calibrate --save`, by online calibration and by re-sizing), then the plans shipped inside the package
(made by the calibrate command for the embedded default pair). A plan's acceptance vector belongs to the model
pair (same architecture fingerprints) and temperature: greedy calls take greedy plans, sampling calls the plan of
the nearest temperature within 0.25. Its latency curves belong to the hardware, threads, dtype and offloading they
were measured on: a plan that fits the pair but not the hardware lends its acceptance vector to a re-sized plan.
"""

from __future__ import annotations

import re
from pathlib import Path

from transformers import PreTrainedModel

from ..core.devices import execution_device, is_offloaded
from ..core.model_info import quantization
from ..core.paths import cache_dir
from ..planning.latency import dtype_name
from ..planning.sizing import HardwareProfile
from .plan_file import SequoiaPlan, model_fingerprint

SHIPPED_DIR = Path(__file__).resolve().parent / "plans"
TEMPERATURE_TOLERANCE = 0.25


def user_plan_dir() -> Path:
    return cache_dir() / "plans"


def is_shipped(path: Path) -> bool:
    return path.resolve().parent == SHIPPED_DIR


def _slug(model: PreTrainedModel) -> str:
    fp = model_fingerprint(model)
    return f"{fp['model_type']}-h{fp['hidden_size']}-l{fp['num_hidden_layers']}"


def plan_filename(target: PreTrainedModel, draft: PreTrainedModel, temperature: float) -> str:
    """A readable, unique name for the plan of this pair, placement and temperature."""
    placement = f"{dtype_name(target)}-{execution_device(target).type}{'-offloaded' if is_offloaded(target) else ''}"
    weights = quantization(target)  # a quantized target's plan must not overwrite the plain one's
    if weights is not None:
        placement += "-" + re.sub(r"[^A-Za-z0-9.]+", "-", weights)
    return f"sequoia-{_slug(target)}-{_slug(draft)}-{placement}-T{temperature:g}.json"


def _stored_plans(target: PreTrainedModel, draft: PreTrainedModel) -> list[tuple[SequoiaPlan, Path]]:
    """Every readable stored plan of this pair, this machine's first."""
    found = []
    for folder in (user_plan_dir(), SHIPPED_DIR):
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                plan = SequoiaPlan.load(path)
            except ValueError:
                continue  # a stale or foreign file must not break decoding
            if plan.same_pair(target, draft):
                found.append((plan, path))
    return found


def find_plan(target: PreTrainedModel, draft: PreTrainedModel, temperature: float) -> tuple[SequoiaPlan, Path] | None:
    """The stored plan whose acceptance fits this pair and temperature, one measured on this hardware first."""
    best: tuple[tuple[bool, float], SequoiaPlan, Path] | None = None
    for plan, path in _stored_plans(target, draft):
        if (temperature <= 0) != (plan.temperature <= 0):
            continue
        gap = abs(plan.temperature - temperature)
        key = (not plan.runs_here(target, draft), gap)
        if gap <= TEMPERATURE_TOLERANCE and (best is None or key < best[0]):
            best = (key, plan, path)
    return (best[1], best[2]) if best else None


def find_profile(target: PreTrainedModel, draft: PreTrainedModel) -> HardwareProfile | None:
    """Latency curves stored for this pair on this hardware (any temperature: latency does not depend on it)."""
    for plan, _ in _stored_plans(target, draft):
        if plan.runs_here(target, draft):
            return plan.profile
    return None


def save_user_plan(plan: SequoiaPlan, target: PreTrainedModel, draft: PreTrainedModel) -> Path:
    return plan.save(user_plan_dir() / plan_filename(target, draft, plan.temperature))
