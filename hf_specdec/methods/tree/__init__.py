"""`speculation="tree"`: its config; the drafter is the shared `ModelTreeDrafter` (draft/shaped_tree.py)."""

from .config import DEFAULT_TREE_WIDTHS, TreeConfig

__all__ = ["DEFAULT_TREE_WIDTHS", "TreeConfig"]
