"""A chain that stops where the draft is unsure: Transformers' `assistant_confidence_threshold`, on our drafter.

Each step drafts up to `num_draft_tokens` tokens, one draft pass per token, and stops after the first token whose
draft probability (under the draft's processed scores) is below `threshold`: that token is still proposed, it just
gets no children. Long chains where the draft is sure (code, repeated text), short ones where it is not.

Lossless and exact: the decision to draft deeper reads only tokens already drafted, never whether one is kept, so
the verifier sees a chain the draft proposed as usual (`SizedShapeDrafter` stops levels on the same argument).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from .shaped_tree import ModelTreeDrafter, ShapeLevel


class ConfidentChainDrafter(ModelTreeDrafter):
    """`ModelTreeDrafter` over a chain, whose next level is drafted only while the last token's draft probability is
    at least `threshold` (one scalar read per drafted token)."""

    def __init__(
        self,
        draft_model: PreTrainedModel,
        shape: list[int],
        threshold: float,
        logits_processor: LogitsProcessorList | None = None,
        child_selection: str = "top_k",
        generator: torch.Generator | None = None,
        vocab: int | None = None,
    ) -> None:
        super().__init__(draft_model, shape, logits_processor, child_selection, generator, vocab)
        self.log_threshold = math.log(threshold)  # 0 < threshold < 1: ChainConfig drafts the whole chain for 0
        self._last_logq: torch.Tensor | None = None  # (1, 1): the last drafted token's draft log-probability

    def _step_started(self, tokens: torch.Tensor) -> None:
        self._last_logq = None

    def _level_drafted(self, level: ShapeLevel, kids: torch.Tensor, logq: Callable[[], torch.Tensor]) -> None:
        self._last_logq = logq()

    def _level_pays(self, index: int) -> bool:
        return self._last_logq is None or float(self._last_logq[0, 0]) >= self.log_threshold
