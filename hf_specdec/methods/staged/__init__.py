"""`speculation="staged"`: its config (`config.py`), the stage stack under the draft (`stack.py`: parsing and
building; `merged.py`; `ngram_model.py`, a Katz-backoff n-gram LM). The draft model's drafter is the shared
best-first engine (methods/specexec/best_first.py) with the stack as its lower stage."""

from .config import StagedConfig
from .merged import MergedDrafter
from .ngram_model import NGramModel, NGramModelDrafter
from .stack import parse_stages

__all__ = ["MergedDrafter", "NGramModel", "NGramModelDrafter", "StagedConfig", "parse_stages"]
