"""What `--quantize-target auto` and prepacking measured on this machine, remembered for the next run.

Timing every quantization route and prepacking each model takes minutes on a small CPU, and on one machine (same CPU,
same flags, same library versions, same model and dtype) the answer is the same every time. The first run measures
and saves it in the cache folder; later runs reuse it and say so; `--remeasure` measures again.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import torch
import transformers

from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec.runtime.paths import cache_dir, write_json

FILE = "machine-choices.json"


def machine_key(model_source: str, dtype: torch.dtype) -> str:
    """One key per (CPU model and flags, torch and transformers versions, model, dtype)."""
    facts = [cpu_model(), *cpu_flags(), torch.__version__, transformers.__version__, model_source, str(dtype)]
    return hashlib.sha256("|".join(facts).encode()).hexdigest()[:16]


def recall(key: str) -> dict[str, Any] | None:
    """The choices saved under `key`, or None (no file, another machine, or a file that cannot be read)."""
    try:
        entry = json.loads((cache_dir() / FILE).read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) else None


def remember(key: str, choices: dict[str, Any]) -> None:
    """Save `choices` under `key`, next to other machines' (best effort: an unwritable cache only costs a re-run)."""
    path = cache_dir() / FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        saved = saved if isinstance(saved, dict) else {}
        saved[key] = {**choices, "cpu": cpu_model(), "measured": time.strftime("%Y-%m-%d %H:%M")}
        write_json(path, saved)
    except (OSError, ValueError):
        pass
