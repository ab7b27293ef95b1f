"""`speculation="specexec"`: its config; the drafter is the shared best-first engine (draft/best_first.py)."""

from .config import SpecExecConfig

__all__ = ["SpecExecConfig"]
