"""A Sequoia plan file: the tree, and everything that produced it (JSON, never pickle).

It records the acceptance vector, the latency curves, the models, dtype, device and library versions, so a
plan can be found again for the same pair on the same hardware, and so anyone can see why this tree was chosen.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from ...core.version import __version__
from ...plan.latency import dtype_name, placement
from ...plan.sizing import HardwareProfile
from ...runtime.devices import cpu_model
from ...runtime.model_info import quantization
from ...runtime.paths import json_list, json_object, write_json
from ...verify.registry import VERIFIERS
from .dp import TreePlan

FORMAT = 1
RECORD_FIELDS = ("target", "draft", "predicted", "measured", "environment")  # free-form JSON objects
# what reading a plan raises on a wrong type, a missing field or an impossible value
INVALID_VALUE = (KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError)
FINGERPRINT_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads",
)


def model_fingerprint(model: PreTrainedModel) -> dict[str, Any]:
    """The architecture fields that decide speed and behaviour; a Hub copy and a converted copy share them."""
    config = model.config.get_text_config()
    return {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS}


def model_record(model: PreTrainedModel) -> dict[str, Any]:
    """How a plan names a model: where it came from, plus its fingerprint."""
    return {"name": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
            "fingerprint": model_fingerprint(model)}


def environment() -> dict[str, Any]:
    return {
        "hf_specdec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "processor": cpu_model(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass
class SequoiaPlan:
    """What `speculation="sequoia"` decodes with, and how it was made."""

    tree: TreePlan
    temperature: float  # 0 = greedy
    verifier: str
    profile: HardwareProfile | None
    target: dict[str, Any]
    draft: dict[str, Any]
    acceptance_positions: int = 0
    predicted: dict[str, float] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    candidates: list[dict] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # how it was made: "calibrate command", "online calibration", ...

    @property
    def parents(self) -> list[int]:
        return self.tree.parents

    @property
    def acceptance(self) -> list[float]:
        return self.tree.acceptance

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "temperature": self.temperature,
            "verifier": self.verifier,
            "tree": self.tree.to_dict(),
            "acceptance_positions": self.acceptance_positions,
            "profile": self.profile.to_dict() if self.profile else None,
            "target": self.target,
            "draft": self.draft,
            "predicted": self.predicted,
            "measured": self.measured,
            "environment": self.environment,
            "candidates": self.candidates,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SequoiaPlan:
        """Read a plan checked by value (see `TreePlan.from_dict`, `LatencyCurve`): what a file says is used as
        written, so anything impossible is a ValueError or TypeError here, never a crash or a mis-sized tree later."""
        data = json_object(data, "A Sequoia plan")
        if data.get("format") != FORMAT:
            raise ValueError(f"Unsupported Sequoia plan format {data.get('format')!r} (this version reads {FORMAT}).")
        plan = cls(
            tree=TreePlan.from_dict(data["tree"]),
            temperature=float(data["temperature"]),
            verifier=str(data["verifier"]),
            profile=HardwareProfile.from_dict(data["profile"]) if data.get("profile") else None,
            acceptance_positions=int(data.get("acceptance_positions", 0)),
            candidates=json_list(data.get("candidates", []), "The plan's 'candidates'"),
            source=str(data.get("source", "")),
            **{name: dict(json_object(data.get(name, {}), f"The plan's {name!r}")) for name in RECORD_FIELDS},
        )
        plan.check_values()
        return plan

    def check_values(self) -> None:
        """Raise ValueError unless the temperature, verifier and counts are possible ones."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}.")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"Unknown verifier {self.verifier!r}; known: {', '.join(sorted(VERIFIERS))}.")
        if self.acceptance_positions < 0:
            raise ValueError(f"acceptance_positions counts positions, got {self.acceptance_positions}.")

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a reader never sees half a file)."""
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> SequoiaPlan:
        return cls.from_json_data(read_json(path), path)

    @classmethod
    def from_json_data(cls, data: Any, path: str | os.PathLike) -> SequoiaPlan:
        """`from_dict` on what the file `path` holds, any failure a ValueError naming the file and the fault."""
        try:
            return cls.from_dict(data)
        except INVALID_VALUE as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"{path} is not a valid Sequoia plan ({detail}). Re-run `hf-specdec calibrate`.") from exc

    def same_pair(self, target: PreTrainedModel, draft: PreTrainedModel) -> bool:
        """Made for these two architectures? Then its acceptance vector applies, whatever the hardware."""
        return (self.target.get("fingerprint") == model_fingerprint(target)
                and self.draft.get("fingerprint") == model_fingerprint(draft))

    def runs_here(self, target: PreTrainedModel, draft: PreTrainedModel) -> bool:
        """Were its latency curves measured on this hardware, thread count, dtype and offloading?"""
        return self.profile is not None and self.profile.placement == pair_placement(target, draft)


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in `path`; a file that cannot be read or parsed is a ValueError saying why."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8
        raise ValueError(f"Cannot read the Sequoia plan {path}: {exc}. Re-run `hf-specdec calibrate`.") from exc


def pair_placement(target: PreTrainedModel, draft: PreTrainedModel) -> dict[str, Any]:
    """The target's placement (see `latency.placement`) plus the draft's dtype (a quantized draft is faster)."""
    draft_weights = quantization(draft)
    return {**placement(target), "draft_dtype": dtype_name(draft),
            **({} if draft_weights is None else {"draft_quantization": draft_weights})}
