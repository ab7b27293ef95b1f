"""`speculation="chain"`: its config; the drafter is the shared `ModelTreeDrafter` (draft/shaped_tree.py)."""

from .config import ChainConfig

__all__ = ["ChainConfig"]
