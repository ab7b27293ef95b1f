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

from .shaped_tree import ModelTreeDrafter, ShapeLevel, read_with_tokens


class ConfidentChainDrafter(ModelTreeDrafter):
    """`ModelTreeDrafter` over a chain, whose next level is drafted only while the last token's draft probability is
    at least `threshold`: one read per drafted level, which also brings the drafted tokens where the chain stops (a
    step that stops reads nothing more than a whole chain's step)."""

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
        self._tokens: torch.Tensor | None = None  # the step's tokens (-1 where not drafted yet), filled level by level
        self._last_logq: Callable[[], torch.Tensor] | None = None  # the last level's draft log-probabilities, (1, 1)
        self._read: list[int] | None = None  # the drafted tokens, read with the decision that stopped the chain

    def _step_started(self, tokens: torch.Tensor) -> None:
        self._tokens, self._last_logq, self._read = tokens, None, None

    def _level_drafted(self, level: ShapeLevel, kids: torch.Tensor, logq: Callable[[], torch.Tensor]) -> None:
        self._last_logq = logq  # computed only if a deeper level is asked about

    def _level_pays(self, index: int) -> bool:
        if self._last_logq is None:
            return True
        sure, tokens = read_with_tokens(self._last_logq()[0, 0] >= self.log_threshold, self._tokens)  # -inf: no child
        if not sure:
            self._read = tokens
        return sure

    def _read_tokens(self, tokens: torch.Tensor) -> list[int]:
        return self._read if self._read is not None else tokens.tolist()
