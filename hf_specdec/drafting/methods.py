"""`speculation="chain"` and `speculation="tree"`: a draft model grows a fixed shape each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..config import SpeculationConfig, register_speculation
from ..planning.shapes import chain_parents, validate_parents, widths_parents
from .model_tree import ModelTreeDrafter

# Wide and shallow: on a 2-core CPU a 32-node target pass costs < 2 single-token passes, while each
# extra level costs a whole draft pass (DESIGN.md §4).
DEFAULT_TREE_WIDTHS = [4, 2, 1, 1]


class StaticShapeConfig(SpeculationConfig):
    """A method whose every step drafts the same tree shape with the assistant model."""

    def shape(self) -> list[int]:
        raise NotImplementedError

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> ModelTreeDrafter:
        return ModelTreeDrafter(assistant_model, self.shape(), logits_processor, child_selection, generator)


@register_speculation
@dataclass
class ChainConfig(StaticShapeConfig):
    """Classic speculative decoding: the draft proposes one chain of `num_draft_tokens` tokens per step."""

    method = "chain"
    num_draft_tokens: int = field(default=4, metadata={"help": "Tokens drafted per step (chain length)."})

    def validate(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}.")

    def shape(self) -> list[int]:
        return chain_parents(self.num_draft_tokens)


@register_speculation
@dataclass
class TreeConfig(StaticShapeConfig):
    """A static tree: give `widths` (children of every node, per level) or an explicit `parents` list."""

    method = "tree"
    widths: list[int] | None = field(
        default=None,
        metadata={"help": f"Children of every node at each level, e.g. [4, 2, 1]. Default {DEFAULT_TREE_WIDTHS}."},
    )
    parents: list[int] | None = field(
        default=None,
        metadata={"help": "Explicit shape: parents[i] is node i's parent, -1 for the root, breadth-first order."},
    )

    def validate(self) -> None:
        if self.widths is not None and self.parents is not None:
            raise ValueError("Give a tree either `widths` or `parents`, not both.")
        if self.widths is not None and (not self.widths or any(int(w) < 1 for w in self.widths)):
            raise ValueError(f"Tree widths must be positive integers, one per level, got {self.widths!r}.")
        if self.parents is not None:
            validate_parents(list(self.parents))

    def shape(self) -> list[int]:
        if self.parents is not None:
            return list(self.parents)
        return widths_parents(list(self.widths or DEFAULT_TREE_WIDTHS))
