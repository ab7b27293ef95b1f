"""`speculation="specexec"`: best-first trees of the draft's most probable continuations (SpecExec)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.config import register_speculation
from ...plan.step_sizing import FRONTIER_SIZES
from ...runtime.model_info import vocab_size
from ..step_sized import StepSizedConfig
from .best_first import BestFirstDrafter


@register_speculation
@dataclass
class SpecExecConfig(StepSizedConfig):
    """`speculation="specexec"`: best-first trees of the draft's most probable continuations (SpecExec).

    Without a `budget`, the tree is sized every step by a cost model (plan/step_sizing.py): the pair's latency
    curves (from the plan store shared with `speculation="sequoia"`: stored, re-sized for this hardware, or measured
    at first use) and the draft's probabilities mapped to how often the target agrees, learned while generating.
    It keeps drafting while another pass is predicted to lower the time per token (deep trees when the draft is
    sure, none beyond the root's children when it is not; hundreds of nodes when accelerate offloads the target and
    every pass costs the same) and verifies the best prefix. With a `budget`, every step grows a tree of that size.
    """

    method = "specexec"
    budget: int | None = field(
        default=None,
        metadata={"help": "Tree size incl. the root (2 to 4096). Default: sized every step by the cost model."},
    )
    max_depth: int = field(default=12, metadata={"help": "Deepest drafted token (levels below the root)."})
    width: int = field(default=8, metadata={"help": "Children considered per expanded node."})
    beams: int | None = field(default=None, metadata={"help": "Nodes expanded per draft pass (default budget/8)."})
    max_budget: int = field(default=2048, metadata={"help": "Largest tree the per-step sizing may grow."})
    captured: bool = field(
        default=False,
        metadata={"help": "Run each step as one function of device work with fixed shapes, read once "
                  "(decoding/captured.py; the tree grown best first on the device, methods/specexec/"
                  "captured_growth.py), compiled whole where the call compiles its forward (a GPU with a static "
                  "cache): a fixed budget, or one of a few sized every step; a static cache, greedy or sampled "
                  "(verified by target sampling), with repetition_penalty and the processors that read a row alone "
                  "(temperature, top_k, top_p, min_p, ...); any other call is refused up front, saying why."},
    )

    def validate(self) -> None:
        if self.budget is not None and not 2 <= int(self.budget) <= 4096:
            raise ValueError(f"budget must be between 2 and 4096 tokens, got {self.budget!r}.")
        for name in ("max_depth", "width", "max_budget") + (("beams",) if self.beams is not None else ()):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}.")

    def make_drafter(self, target, assistant_model, logits_processor, child_selection, generator) -> BestFirstDrafter:
        return BestFirstDrafter(assistant_model, **self.growth(target, assistant_model, logits_processor),
                                vocab=vocab_size(target))

    def growth(self, target, assistant_model, logits_processor) -> dict:
        """How a tree grows for one sequence (or one row of a batch): `Grower`'s settings, its cost model included
        (None with a fixed budget)."""
        sizer = self.make_sizer(target, assistant_model, logits_processor)
        budget = self.max_budget if sizer is not None else int(self.budget)
        beams = self.beams or (max(FRONTIER_SIZES) if sizer is not None else None)
        return dict(budget=budget, max_depth=self.max_depth, width=self.width, beams=beams,
                    logits_processor=logits_processor, sizer=sizer)
