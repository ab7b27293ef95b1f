"""What the speculative loop needs of a call that Transformers would not pass to a `custom_generate` callable."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.config import SpeculationConfig, settings
from ..plan.step_sizing import processors_key


@dataclass
class SpeculationCall:
    """Everything the speculative loop needs that Transformers would not pass to a `custom_generate` callable."""

    config: SpeculationConfig
    assistant_model: PreTrainedModel | None
    streamer: Any
    generator: torch.Generator | None
    tokenizer: Any = None  # for stop strings (Transformers drops `tokenizer` before calling a callable)
    stop_strings: str | list[str] | None = None  # the call's, or its generation config's


def guard_key(call: SpeculationCall, processors: Any, rows: int) -> Hashable:
    """What a measured guard is remembered by across calls on one target and draft (`plan.guard.remembered_guard`):
    the method and the settings the call gave (before a plan is looked up: the first call measures it, the next finds
    it stored, and both draft the same trees), what of the processors changes acceptance, and the batch size."""
    config = call.config
    values = tuple((f.name, _hashable(getattr(config, f.name))) for f in settings(config))
    return (config.method, values, processors_key(processors), rows)


def _hashable(value: Any) -> Hashable:
    """A setting as a key: plain values as they are, lists, tuples and dicts by their items, anything else (a model,
    a plan object) by its identity."""
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(item) for item in value)
    if isinstance(value, dict):
        return tuple((str(name), _hashable(item)) for name, item in value.items())
    return ("id", id(value))
