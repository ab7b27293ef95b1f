"""Entry points: `generate(..., speculation=...)`."""

from .generate import SpeculationCall, install, speculative_generate, uninstall

__all__ = ["SpeculationCall", "install", "speculative_generate", "uninstall"]
