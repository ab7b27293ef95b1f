"""What the speculative loop needs of a call that Transformers would not pass to a `custom_generate` callable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..core.config import SpeculationConfig


@dataclass
class SpeculationCall:
    """Everything the speculative loop needs that Transformers would not pass to a `custom_generate` callable."""

    config: SpeculationConfig
    assistant_model: PreTrainedModel | None
    streamer: Any
    generator: torch.Generator | None
    tokenizer: Any = None  # for stop strings (Transformers drops `tokenizer` before calling a callable)
    stop_strings: str | list[str] | None = None  # the call's, or its generation config's
