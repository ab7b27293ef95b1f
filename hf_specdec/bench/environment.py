"""The machine and software a benchmark ran on, written next to its numbers (figures mean nothing without them)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

import psutil
import torch

PACKAGES = ("torch", "transformers", "accelerate", "hf_specdec")
#: instruction-set extensions that decide CPU matmul speed, reported when /proc/cpuinfo lists them
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "neon", "bf16")
#: flags of CPUs that multiply bfloat16 natively (x86 AVX512-BF16 / AMX, Arm BF16)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("flags", "features")):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in CPU_FLAGS if flag in present]
    except OSError:
        pass
    return []


def native_bfloat16(cuda: bool) -> bool:
    """Whether bfloat16 matmuls run natively where the models run: a GPU that supports it, or a CPU flag."""
    if cuda:
        return torch.cuda.is_bf16_supported()
    return any(flag in NATIVE_BF16_FLAGS for flag in cpu_flags())


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def accelerator() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "none (CPU)"


def collect_environment() -> dict[str, Any]:
    """CPU, cores, threads, memory, load (a busy shared machine shows here), versions and the date."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count_logical": psutil.cpu_count(logical=True),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": psutil.virtual_memory().total,
        "load_average_1_5_15": list(load) if load else None,
        "accelerator": accelerator(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {package: _version(package) for package in PACKAGES},
    }
