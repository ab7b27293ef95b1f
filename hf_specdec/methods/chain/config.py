"""`speculation="chain"`: classic speculative decoding, one drafted chain per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ...core.config import register_speculation
from ...draft.confident_chain import ConfidentChainDrafter
from ...draft.shaped_tree import ModelTreeDrafter
from ...plan.shapes import chain_parents
from ...runtime.model_info import vocab_size
from ..static_shape import StaticShapeConfig


@register_speculation
@dataclass
class ChainConfig(StaticShapeConfig):
    """Classic speculative decoding: the draft proposes one chain per step, of up to `num_draft_tokens` tokens,
    stopped where the draft is unsure (Transformers' assisted generation's defaults)."""

    method = "chain"
    drafts_chains = True
    num_draft_tokens: int = field(
        default=20, metadata={"help": "The most tokens drafted per step (chain length); 20, as Transformers' "
                              "num_assistant_tokens."})
    confidence_threshold: float | None = field(
        default=0.4,
        metadata={"help": "Stop a step's chain after a token the draft gives a probability below this (Transformers' "
                  "assistant_confidence_threshold, 0.4 by default there too): long chains where the draft is sure, "
                  "short ones where it is not. None or 0: always num_draft_tokens. A batch drafts one length for "
                  "all its rows: on while its rows' chains, averaged, are at least this likely to go on."},
    )
    adapt_threshold: bool = field(
        default=False,
        metadata={"help": "Learn the threshold during the call, starting from confidence_threshold, as Transformers' "
                  "assisted generation does where scikit-learn is installed: after every step, the one that would "
                  "have cost least over the draft probabilities and verdicts seen so far (a rejected token drafted "
                  "on costs 1, a kept token stopped at 3; plan/confidence.py). Off by default: on a Zen 3 it cut "
                  "draft passes 15% and target-pass tokens 8% with no measurable gain, and deeper chains read the "
                  "host once per level. A batch keeps the threshold fixed."},
    )

    def validate(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}.")
        threshold = self.confidence_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0 <= threshold < 1):
            raise ValueError(f"confidence_threshold must be a probability in [0, 1) or None, got {threshold!r}.")
        if not isinstance(self.adapt_threshold, bool):
            raise ValueError(f"adapt_threshold must be True or False, got {self.adapt_threshold!r}.")

    def stop_below(self) -> float | None:
        return float(self.confidence_threshold) if self.confidence_threshold else None  # 0 stops nothing

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> ModelTreeDrafter:
        if self.stop_below() is None:  # the whole chain every step
            return super().make_drafter(target, assistant_model, logits_processor, child_selection, generator)
        return ConfidentChainDrafter(assistant_model, self.shape(), self.stop_below(), logits_processor,
                                     child_selection, generator, vocab_size(target), adapt=self.adapt_threshold)

    def shape(self) -> list[int]:
        return chain_parents(self.num_draft_tokens)
