"""`speculation="prompt_lookup"` (alias `"ngram"`): prompt-lookup trees, no draft model at all."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.config import SpeculationConfig, register_speculation
from .drafter import PromptLookupDrafter
from .sizing import learned_sizer


@register_speculation
@dataclass
class PromptLookupConfig(SpeculationConfig):
    """`speculation="prompt_lookup"`: trees of continuations looked up in the prompt and the generated text, no draft
    model at all. `"ngram"` is its older name, kept as an alias (not to be confused with `NGramModel`, the Katz n-gram
    language model a staged stack can draft with)."""

    method = "prompt_lookup"
    aliases = ("ngram",)
    needs_assistant = False
    max_ngram: int = field(default=3, metadata={"help": "Longest n-gram matched against the context."})
    min_ngram: int = field(default=1, metadata={"help": "Shortest n-gram tried when longer ones do not recur."})
    depth: int = field(default=8, metadata={"help": "Tokens taken after each match (tree depth)."})
    max_nodes: int = field(default=32, metadata={"help": "Tree size including the root."})
    max_matches: int = field(default=32, metadata={"help": "Most recent matches merged into the tree."})
    sized: bool = field(default=True, metadata={"help": (
        "Cut each tree to the nodes predicted to pay for the target's longer pass (acceptance learned while "
        "generating, pass times measured), down to a plain step when none do; False: always the whole tree.")})

    def validate(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"Need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}.")
        for name in ("depth", "max_nodes", "max_matches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}.")
        if not isinstance(self.sized, bool):
            raise ValueError(f"sized must be True or False, got {self.sized!r}.")

    def make_drafter(
        self, target, assistant_model, logits_processor, child_selection, generator
    ) -> PromptLookupDrafter:
        return PromptLookupDrafter(
            self.max_ngram, self.min_ngram, self.depth, self.max_nodes, self.max_matches,
            sizer=learned_sizer(target) if self.sized else None,
        )


NGramConfig = PromptLookupConfig  # the name before `prompt_lookup`, kept for code that imports it
