"""Drafting machinery the methods share: the draft-model runner (`draft_model.py`), the static-shape drafter
(`shaped_tree.py`: chain, tree, sequoia), the best-first engine (`best_first.py`: specexec, staged), prompt lookup
(`prompt_lookup.py`: ngram, the cheapest staged stage), child selection and the int8 draft (`quantize.py`)."""

from .best_first import BestFirstDrafter
from .draft_model import DraftModelRunner
from .prompt_lookup import NGramDrafter
from .quantize import quantize_draft
from .shaped_tree import ModelTreeDrafter, StaticShapeConfig

__all__ = ["BestFirstDrafter", "DraftModelRunner", "ModelTreeDrafter", "NGramDrafter", "StaticShapeConfig",
           "quantize_draft"]
