"""`speculation="staged"`: staged speculative decoding (Spector & Ré, 2023): the draft is itself sped up by cheaper
drafters below it, a stack of any depth, e.g. target <- draft model <- smaller model <- n-gram lookup.

The draft model grows best-first trees (the engine SpecExec uses, methods/specexec/best_first.py) and confirms the lower
stage's guesses in the same passes; `stack.py` turns the `stages` setting into that lower stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.config import register_speculation, settings
from ...runtime.model_info import vocab_size
from ..specexec.best_first import BestFirstDrafter
from ..step_sized import StepSizedConfig
from .stack import build_stack, parse_stages

FIXED_BUDGET_PASSES = 3  # draft passes per step with a fixed budget
MAX_BUDGET = 128  # the largest tree the per-step sizing may grow


@register_speculation
@dataclass
class StagedConfig(StepSizedConfig):
    """`speculation="staged"`: the draft model grows best-first trees, several levels per pass where the stages
    below it guess right (default: prompt lookup under `assistant_model`). Without a `budget`, trees are sized
    every step by the cost model `specexec` uses."""

    method = "staged"
    stages: list[Any] | None = field(
        default=None,
        metadata={"help": "What drafts for the draft model, most expensive first: 'ngram' (prompt lookup), "
                  "{'ngram_model': 'file.json'} (Katz backoff LM), a smaller causal LM or {'model': lm, 'budget': 12}, "
                  "a list of n-gram stages merged into one. Default ['ngram']; [] drafts with the draft model alone."},
    )
    budget: int | None = field(default=None, metadata={"help": "Tree size handed to the target, root included. "
                                                        "Default: sized every step by the cost model."})
    max_depth: int = field(default=10, metadata={"help": "Deepest drafted token (levels below the root)."})
    width: int = field(default=4, metadata={"help": "Children the draft model considers per expanded node; a lower "
                                            "stage's token is confirmed when it is among them."})
    beams: int = field(default=4, metadata={"help": "Most probable unexpanded nodes forwarded per draft pass."})
    max_passes: int | None = field(default=None, metadata={"help": "Most draft-model passes per step (the first one "
                                                        "also catches the draft cache up with the accepted tokens). "
                                                        "Default: 3 with a budget, else as the cost model decides."})
    lower_leaves: int = field(default=1, metadata={"help": "Forwarded nodes per pass that get a lower-stage "
                                                   "continuation tree, best first (the first pass: the root)."})
    min_prob: float = field(default=0.0, metadata={"help": "Another draft pass only while the most probable "
                                                   "unexpanded node has at least this cumulative draft probability."})

    def validate(self) -> None:
        for name in ("budget", "max_depth", "width", "beams", "max_passes", "lower_leaves"):
            value = getattr(self, name)
            if value is None and name in ("budget", "max_passes"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.min_prob, (int, float)) or not 0 <= self.min_prob < 1:
            raise ValueError(f"min_prob must be a number in [0, 1), got {self.min_prob!r}.")
        if self.budget is not None and self.budget < 2:
            raise ValueError(f"budget counts the root too, so it must be at least 2, got {self.budget}.")
        parse_stages(self.stages)

    def to_dict(self) -> dict[str, Any]:
        """Settings as given (shallow: model objects in `stages` are not copied)."""
        return {"method": self.method, **{f.name: getattr(self, f.name) for f in settings(self)}}

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> BestFirstDrafter:
        below = build_stack(self.stages, target, logits_processor)
        sizer = self.make_sizer(target, assistant_model, logits_processor)
        max_passes = self.max_passes or (None if sizer is not None else FIXED_BUDGET_PASSES)
        return BestFirstDrafter(assistant_model, self.budget or MAX_BUDGET, self.max_depth, self.width, self.beams,
                                logits_processor, lower=below, max_passes=max_passes, lower_leaves=self.lower_leaves,
                                min_prob=self.min_prob, sizer=sizer, vocab=vocab_size(target))
