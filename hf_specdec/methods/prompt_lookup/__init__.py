"""`speculation="prompt_lookup"` (alias `"ngram"`): its config; the drafter is the shared prompt-lookup drafter
(draft/prompt_lookup.py), which a staged stack also uses as its cheapest stage."""

from .config import NGramConfig, PromptLookupConfig

__all__ = ["NGramConfig", "PromptLookupConfig"]
