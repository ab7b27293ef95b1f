"""The speculative loop, KV-cache compaction, outputs and stats."""

from .loop import speculative_loop
from .outputs import SpeculativeDecoderOnlyOutput
from .stats import SpeculationStats

__all__ = ["SpeculationStats", "SpeculativeDecoderOnlyOutput", "speculative_loop"]
