"""`speculation="chain"`: its config; the drafter is the shared `ModelTreeDrafter` (draft/shaped_tree.py), or with a
`confidence_threshold` its `ConfidentChainDrafter` (draft/confident_chain.py)."""

from .config import ChainConfig

__all__ = ["ChainConfig"]
