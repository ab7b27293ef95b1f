"""The speculative loop (draft, verify, accept, repeat), its stats and its output type."""

from .loop import speculative_loop
from .outputs import SpeculativeDecoderOnlyOutput
from .stats import SpeculationStats

__all__ = ["SpeculationStats", "SpeculativeDecoderOnlyOutput", "speculative_loop"]
