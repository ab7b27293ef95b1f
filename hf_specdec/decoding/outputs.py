"""Transformers' own output type, plus the speculation stats."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import GenerateDecoderOnlyOutput

from .stats import SpeculationStats


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` with `speculation_stats`: what the speculation did in this call."""

    speculation_stats: SpeculationStats | None = None
