"""Where a model computes, whether accelerate keeps its weights elsewhere, and what the CPU can do.

`model.device` is the device of the first parameter: for a model offloaded with accelerate that is often
`meta` (the weights live on disk), which is no place to build inputs. The execution device of accelerate's hook
is where the forward pass really runs.
"""

from __future__ import annotations

import collections
import hashlib
import platform
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .ranks import sharding_mesh

#: set on a model whose kernels were swapped (see hf_specdec.kernels): its latency curves differ from the default's
KERNELS_ATTRIBUTE = "_hf_specdec_kernels"


def kernels(model: PreTrainedModel) -> str:
    """Which kernels the model's passes use: "default" or what hf_specdec.kernels put in."""
    return str(getattr(model, KERNELS_ATTRIBUTE, "default"))


def execution_device(model: PreTrainedModel) -> torch.device:
    """The device the model's forward pass runs on: accelerate's execution device, else `model.device`."""
    hook_device = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device)  # an int is an accelerator ordinal (GPU machines only)
    device_map = getattr(model, "hf_device_map", None) or {}
    for place in device_map.values():  # the first module kept on a compute device
        if str(place) not in ("disk", "meta"):
            return torch.device(place)
    return model.device if model.device.type != "meta" else torch.device("cpu")


def compute_devices(model: PreTrainedModel) -> list[torch.device]:
    """Every device the model's layers compute on (accelerate's device map over several GPUs lists each once), the
    execution device first; disk and CPU-offloaded weights compute on the execution device."""
    first = execution_device(model)
    places = [first]
    for place in (getattr(model, "hf_device_map", None) or {}).values():
        if str(place) in ("disk", "meta") or (str(place) == "cpu" and first.type != "cpu"):
            continue
        device = torch.device(place) if not isinstance(place, int) else torch.device("cuda", place)
        if device not in places:
            places.append(device)
    return places


def device_layout(model: PreTrainedModel) -> str | None:
    """How the model is spread, where that changes its latency: "tp<N>" for a target sharded over N ranks, a short
    hash of an accelerate device map over several devices; None for a model on one device (offloading is said
    apart, by `is_offloaded`)."""
    parts = []
    mesh = sharding_mesh(model)
    if mesh is not None:
        parts.append(f"tp{mesh.size()}")
    device_map = getattr(model, "hf_device_map", None) or {}
    if len({str(place) for place in device_map.values()}) > 1:
        listed = ",".join(f"{name}:{place}" for name, place in sorted(device_map.items()))
        parts.append("map-" + hashlib.sha1(listed.encode()).hexdigest()[:8])
    return "-".join(parts) or None


#: per-pass times a PassClock keeps (`seconds_since` asks for one step's passes)
RECENT_PASSES = 256


class PassClock:
    """Seconds model passes take on `device` (or on each of several devices a model spans), added up, for cost
    models and statistics.

    On CUDA the kernels run after the Python call returns, so wall time would see only their launch: CUDA events
    around each pass measure the work itself, and are read only when `total` is asked for (a step that never asks
    never waits for them). A pass over several GPUs (an accelerate device map) ends on whichever GPU holds the last
    layers, which one device's events do not see: its wall time is taken with every one of them synchronised.
    Elsewhere, wall time.
    """

    def __init__(self, device: torch.device | list[torch.device]) -> None:
        devices = [torch.device(d) for d in (device if isinstance(device, (list, tuple)) else [device])]
        self._gpus = [d for d in devices if d.type == "cuda"]
        self.cuda = len(self._gpus) == 1
        self._seconds = 0.0
        self._began = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_PASSES)  # each pass's seconds
        self.passes = 0  # passes timed so far: a mark for `seconds_since`, read without waiting

    def _synchronize(self) -> None:
        for gpu in self._gpus if len(self._gpus) > 1 else ():
            torch.cuda.synchronize(gpu)

    def start(self) -> None:
        if self.cuda:
            self._pending.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._pending[-1][0].record(torch.cuda.current_stream(self._gpus[0]))
        else:
            self._synchronize()
            self._began = time.perf_counter()

    def stop(self) -> None:
        self.passes += 1
        if self.cuda:
            self._pending[-1][1].record(torch.cuda.current_stream(self._gpus[0]))
        else:
            self._synchronize()
            self._add(time.perf_counter() - self._began)

    def _add(self, seconds: float) -> None:
        self._seconds += seconds
        self._recent.append(seconds)

    @property
    def total(self) -> float:
        """Seconds of every pass timed so far (on CUDA, waits for the last timed pass to finish)."""
        for begin, end in self._pending:
            end.synchronize()
            self._add(begin.elapsed_time(end) / 1e3)
        self._pending.clear()
        return self._seconds

    def seconds_since(self, mark: int) -> list[float]:
        """The seconds of each pass timed since `passes` was `mark` (on CUDA, waits for them: a drafter asks once
        its step's verdict has been read, when they are long done, rather than stall the device between passes)."""
        self.total  # noqa: B018  (resolves the pending events)
        count = self.passes - mark
        if count > len(self._recent):
            raise ValueError(f"Only the last {len(self._recent)} passes' times are kept, not {count}.")
        return list(self._recent)[len(self._recent) - count :] if count else []


def is_offloaded(model: PreTrainedModel) -> bool:
    """True when accelerate keeps some of the model's weights off its compute device (CPU RAM or disk).

    Such a model pays its weight transfer on every pass, whatever the number of tokens: its curve is flat.
    """
    device_map = getattr(model, "hf_device_map", None) or {}
    places = {str(place) for place in device_map.values()}
    return "disk" in places or ("cpu" in places and execution_device(model).type != "cpu")


#: instruction-set extensions that decide CPU matmul speed, reported when /proc/cpuinfo lists them
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "neon", "bf16")
#: flags of CPUs that multiply bfloat16 natively (x86 AVX512-BF16 / AMX, Arm BF16)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo, keys lower-cased (empty where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what `platform` knows."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_family_model() -> str | None:
    """`family F model M` from /proc/cpuinfo (x86): what tells CPU generations apart where the marketing name does
    not (a cloud's "AMD EPYC" is Zen 3 at family 25 model 1, Zen 4 at family 25 model 17); None elsewhere."""
    fields = cpuinfo()
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_flags() -> list[str]:
    """The instruction-set extensions of CPU_FLAGS this CPU lists (x86 `flags`, Arm `features`)."""
    fields = cpuinfo()
    present = set((fields.get("flags") or fields.get("features") or "").split())
    return [flag for flag in CPU_FLAGS if flag in present]


def native_bfloat16(cuda: bool) -> bool:
    """Whether bfloat16 matmuls run natively where the models run: a GPU that supports it, or a CPU flag."""
    if cuda:
        return torch.cuda.is_bf16_supported()
    return any(flag in NATIVE_BF16_FLAGS for flag in cpu_flags())
