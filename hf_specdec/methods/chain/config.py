"""`speculation="chain"`: classic speculative decoding, one drafted chain per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.config import register_speculation
from ...plan.shapes import chain_parents
from ..static_shape import StaticShapeConfig


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
