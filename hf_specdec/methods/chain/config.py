"""`speculation="chain"`: classic speculative decoding, one drafted chain per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ...core.config import register_speculation
from ...core.model_info import vocab_size
from ...draft.confident_chain import ConfidentChainDrafter
from ...draft.shaped_tree import ModelTreeDrafter
from ...plan.shapes import chain_parents
from ..static_shape import StaticShapeConfig


@register_speculation
@dataclass
class ChainConfig(StaticShapeConfig):
    """Classic speculative decoding: the draft proposes one chain of `num_draft_tokens` tokens per step."""

    method = "chain"
    num_draft_tokens: int = field(default=4, metadata={"help": "Tokens drafted per step (chain length)."})
    confidence_threshold: float | None = field(
        default=None,
        metadata={"help": "Stop a step's chain after a token the draft gives a probability below this (Transformers' "
                  "assistant_confidence_threshold; its assisted generation drafts up to 20 tokens at 0.4). None: "
                  "always num_draft_tokens (0 too). One sequence at a time: a batch drafts one length for all rows."},
    )

    def validate(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}.")
        threshold = self.confidence_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0 <= threshold < 1):
            raise ValueError(f"confidence_threshold must be a probability in [0, 1) or None, got {threshold!r}.")

    def batch_refusal(self) -> tuple[str, str] | None:
        if self.confidence_threshold:  # 0 stops nothing, as in Transformers
            return ("chain's confidence_threshold (a batch drafts one chain length for all its rows)",
                    "drop confidence_threshold from speculation_config")
        return None

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> ModelTreeDrafter:
        if not self.confidence_threshold:  # None or 0: the whole chain every step
            return super().make_drafter(target, assistant_model, logits_processor, child_selection, generator)
        return ConfidentChainDrafter(assistant_model, self.shape(), float(self.confidence_threshold),
                                     logits_processor, child_selection, generator, vocab_size(target))

    def shape(self) -> list[int]:
        return chain_parents(self.num_draft_tokens)
