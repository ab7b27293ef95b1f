"""`speculation="prompt_lookup"` (alias `"ngram"`): its config (`config.py`), its drafter (`drafter.py`: continuations
of earlier occurrences of the context's last n-gram, merged into a trie; a staged stack also uses it as its cheapest
stage) and its per-step sizing (`sizing.py`: the looked-up nodes that pay for the target's longer pass)."""

from .config import NGramConfig, PromptLookupConfig
from .drafter import NGramDrafter, PromptLookupDrafter

__all__ = ["NGramConfig", "NGramDrafter", "PromptLookupConfig", "PromptLookupDrafter"]
