"""What the speculative loop needs of a call that Transformers would not pass to a `custom_generate` callable."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.config import SpeculationConfig, settings
from ..draft.best_first import processors_key


@dataclass
class SpeculationCall:
    """Everything the speculative loop needs that Transformers would not pass to a `custom_generate` callable."""

    config: SpeculationConfig
    assistant_model: PreTrainedModel | None
    streamer: Any
    generator: torch.Generator | None
    tokenizer: Any = None  # for stop strings (Transformers drops `tokenizer` before calling a callable)
    stop_strings: str | list[str] | None = None  # the call's, or its generation config's


def guard_key(config: SpeculationConfig, call: SpeculationCall, processors: Any, rows: int) -> Hashable:
    """What a measured guard is remembered by across calls on one target (`plan.guard.remembered_guard`): the
    draft, the method's settings, what of the processors changes acceptance, and the batch size. Not where the plan
    came from: the first call measures it, the next finds it stored, and both draft the same trees."""
    values = tuple((f.name, _hashable(getattr(config, f.name))) for f in settings(config))
    return (config.method, values, id(call.assistant_model), processors_key(processors), rows)


def _hashable(value: Any) -> Hashable:
    """A setting as a key: itself where it is a plain value, else its identity (a model, a list of stages)."""
    return value if isinstance(value, (int, float, str, bool, type(None))) else id(value)
