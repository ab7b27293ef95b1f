"""The machine and software a benchmark ran on, written next to its numbers (figures mean nothing without them)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from typing import Any

import psutil
import torch

from hf_specdec.runtime.devices import cpu_family_model, cpu_flags, cpu_model

PACKAGES = ("torch", "transformers", "accelerate", "hf_specdec")
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
        "cpu_family_model": cpu_family_model(),
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
