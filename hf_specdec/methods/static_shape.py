"""What `chain`, `tree` and `sequoia` share: a config whose every step drafts one tree shape with the assistant
model (`draft/shaped_tree.py`'s `ModelTreeDrafter`); the three differ only in where the shape comes from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.config import ModelDraftConfig
from ..draft.shaped_tree import ModelTreeDrafter
from ..draft.sized_shape import SizedShapeDrafter
from ..logits.child_selection import CHILD_SELECTIONS
from ..plan.shape_sizing import RankAcceptance, ShapeMenu, level_cuts_menu
from ..runtime.model_info import vocab_size
from .step_sized import online_sizer


@dataclass
class StaticShapeConfig(ModelDraftConfig):
    """A method whose every step drafts the same tree shape with the assistant model (`ModelTreeDrafter`)."""

    child_selections = CHILD_SELECTIONS
    default_sampling_verifier = "sequoia"
    captured: bool = field(
        default=False,
        metadata={"help": "Run each step as one function of device work with fixed shapes, read once "
                  "(decoding/captured.py), compiled whole where the call compiles its forward (a GPU with a static "
                  "cache): a fixed shape or a few bucketed ones (sized every step), a static cache, "
                  "greedy or sampled (verifier 'sequoia'), with repetition_penalty and the processors that read a "
                  "row alone (temperature, top_k, top_p, min_p, ...); any other call is refused up front, saying "
                  "why."},
    )

    def shape(self) -> list[int]:
        """The tree to draft, as a parents list (breadth-first, siblings contiguous)."""
        raise NotImplementedError

    def drafts(self) -> bool:
        return len(self.shape()) > 1

    def stop_below(self) -> float | None:
        """A draft probability: a step drafts no deeper level once its last tokens are all less likely than this
        (None: every level of the shape, every step)."""
        return None

    def shape_menu(self) -> ShapeMenu:
        """The shapes a batch sized every step chooses from (the root alone always among them): the shape cut after
        each of its levels (a chain's shorter chains)."""
        return level_cuts_menu(self.shape())

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> ModelTreeDrafter:
        return ModelTreeDrafter(assistant_model, self.shape(), logits_processor, child_selection, generator,
                                vocab_size(target))

    def sized_drafter(
        self,
        plan: Any,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> SizedShapeDrafter:
        """The drafter of a method sized every step: each step drafts the shape of `shape_menu()` the cost model picks,
        with `plan`'s latency curves and acceptance vector (its ranks' prior) and what this pair has learned since;
        levels below the configured shape's depth only where a sure draft grows them."""
        menu = self.shape_menu()
        return SizedShapeDrafter(assistant_model, menu, online_sizer(plan.profile, target, assistant_model,
                                                                     logits_processor),
                                 RankAcceptance(plan.acceptance, menu.width), len(self.shape()), logits_processor,
                                 child_selection, generator, vocab_size(target))
