"""Where Sequoia plans live and how one is found for a model pair.

Two places, searched in this order: plans saved on this machine (`<hf_specdec cache>/plans`, written by
`hf-specdec calibrate --save`, by online calibration and by re-sizing), then the plans shipped inside the package
(made by the calibrate command for the embedded default pair). A plan's acceptance vector belongs to the model
pair (same architecture fingerprints) and temperature: greedy calls take greedy plans, sampling calls the plan of
the nearest temperature within 0.25. Its latency curves belong to the hardware, threads, dtype and offloading they
were measured on: a plan that fits the pair but not the hardware lends its acceptance vector to a re-sized plan.

The folder is read defensively: a plan file that cannot be read or holds impossible values is skipped with one
warning naming it and the fault, and other JSON files dropped there are ignored. A folder that cannot be written
never fails a call: the plan made is kept in memory for the process, with one warning naming `HF_SPECDEC_CACHE`.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from ...plan.latency import dtype_name
from ...plan.sizing import HardwareProfile
from ...runtime.devices import device_layout, execution_device, is_offloaded
from ...runtime.model_info import quantization
from ...runtime.paths import CACHE_ENV, cache_dir
from .plan_file import SequoiaPlan, model_fingerprint, read_json

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent first calls may both calibrate
    fcntl = None

SHIPPED_DIR = Path(__file__).resolve().parent / "plans"
TEMPERATURE_TOLERANCE = 0.25
PLAN_PREFIX = "sequoia-"  # how `plan_filename` starts
LOCK_NAME = ".calibration.lock"

_unsaved: dict[Path, SequoiaPlan] = {}  # plans made in this process that their folder could not take
_warned: set[tuple] = set()  # files and folders already warned about


def user_plan_dir() -> Path:
    return cache_dir() / "plans"


def is_shipped(path: Path) -> bool:
    return path.resolve().parent == SHIPPED_DIR


def describe(path: Path) -> str:
    """How a plan's origin reads in `plan_source`."""
    if path in _unsaved:
        return f"plan {path.name} made earlier in this process (kept in memory)"
    return f"{'shipped' if is_shipped(path) else 'saved'} plan {path.name}"


def _slug(model: PreTrainedModel) -> str:
    fp = model_fingerprint(model)
    return f"{fp['model_type']}-h{fp['hidden_size']}-l{fp['num_hidden_layers']}"


def plan_filename(target: PreTrainedModel, draft: PreTrainedModel, temperature: float) -> str:
    """A readable, unique name for the plan of this pair, placement and temperature."""
    placement = f"{dtype_name(target)}-{execution_device(target).type}{'-offloaded' if is_offloaded(target) else ''}"
    spread = device_layout(target)  # nor a target sharded over ranks or devices the one-device one's
    if spread is not None:
        placement += "-" + spread
    weights = quantization(target)  # a quantized target's plan must not overwrite the plain one's
    if weights is not None:
        placement += "-" + re.sub(r"[^A-Za-z0-9.]+", "-", weights)
    draft_weights = quantization(draft)  # nor an int8 or vocabulary-restricted draft's the plain draft's
    if draft_weights is not None:
        placement += "-draft-" + re.sub(r"[^A-Za-z0-9.]+", "-", draft_weights)
    return f"{PLAN_PREFIX}{_slug(target)}-{_slug(draft)}-{placement}-T{temperature:g}.json"


def _stored_plans(target: PreTrainedModel, draft: PreTrainedModel) -> list[tuple[SequoiaPlan, Path]]:
    """Every valid stored plan of this pair, this machine's first (plans it could not save included)."""
    found = []
    for folder in (user_plan_dir(), SHIPPED_DIR):
        for path in _json_files(folder):
            plan = _read_plan(path)
            if plan is not None and plan.same_pair(target, draft):
                found.append((plan, path))
    found += [(plan, path) for path, plan in _unsaved.items() if path.parent == user_plan_dir()
              and plan.same_pair(target, draft)]
    return found


def _json_files(folder: Path) -> list[Path]:
    try:
        return sorted(folder.glob("*.json")) if folder.is_dir() else []
    except OSError:  # an unreadable folder holds no plan we can use
        return []


def _read_plan(path: Path) -> SequoiaPlan | None:
    """The plan in `path`, or None. A file of ours that fails (unreadable, corrupt, impossible values) warns once,
    naming the fault; anything else in the folder (another tool's JSON) is none of our business."""
    try:
        data = read_json(path)
        if not _looks_like_plan(path, data):
            return None
        return SequoiaPlan.from_json_data(data, path)
    except ValueError as exc:
        if _looks_like_plan(path, None):
            _warn_once(path, f"hf_specdec: skipping the Sequoia plan file {path}: {exc}")
        return None


def _looks_like_plan(path: Path, data: Any) -> bool:
    """Named as `save_user_plan` names plans, or a JSON object with a plan's `format` and `tree` fields."""
    return path.name.startswith(PLAN_PREFIX) or (isinstance(data, dict) and {"format", "tree"} <= data.keys())


def _warn_once(path: Path, message: str) -> None:
    """One warning per file (and version of it), not one per generate call."""
    try:
        stat = path.stat()
        key = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        key = (str(path), None, None)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=2)


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


def save_user_plan(plan: SequoiaPlan, target: PreTrainedModel, draft: PreTrainedModel) -> Path | None:
    """Save `plan` for the next calls; where the folder cannot be written, keep it in memory for this process, warn
    once with the fix, and return None: a plan store that cannot be written never fails a generate call."""
    path = user_plan_dir() / plan_filename(target, draft, plan.temperature)
    try:
        return plan.save(path)
    except OSError as exc:
        _unsaved[path] = plan
        _warn_once(path.parent, f"hf_specdec: cannot save Sequoia plans in {path.parent} ({exc}); this process "
                   f"keeps them in memory only. Set {CACHE_ENV} to a writable folder to keep them across runs.")
        return None


@contextlib.contextmanager
def plan_lock() -> Iterator[None]:
    """Held while a plan is made: two processes sharing the plan folder calibrate once (the second one finds the
    first one's plan once it gets the lock). Without fcntl or a writable folder, nothing is locked."""
    try:
        folder = user_plan_dir()
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / LOCK_NAME, "a")  # noqa: SIM115  (held across the yield)
    except OSError:
        handle = None
    try:
        if handle is not None and fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        if handle is not None:
            handle.close()  # closing releases the lock
