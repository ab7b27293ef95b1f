"""`speculation="specexec"`: its config (`config.py`) and SpecExec's best-first growth (`best_first.py`), which a
staged stack also runs as its draft model's stage."""

from .best_first import BestFirstDrafter
from .config import SpecExecConfig

__all__ = ["BestFirstDrafter", "SpecExecConfig"]
