"""`speculation="ngram"`: its config; the drafter is the shared prompt-lookup drafter (drafting/prompt_lookup.py),
which a staged stack also uses as its cheapest stage."""

from .config import NGramConfig

__all__ = ["NGramConfig"]
