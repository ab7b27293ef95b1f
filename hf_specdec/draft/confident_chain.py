"""A chain that stops where the draft is unsure: Transformers' `assistant_confidence_threshold`, on our drafter.

Each step drafts up to `num_draft_tokens` tokens, one draft pass per token, and stops after the first token whose
draft probability (under the draft's processed scores) is below `threshold`: that token is still proposed, it just
gets no children. Long chains where the draft is sure (code, repeated text), short ones where it is not.

With `adapt`, the threshold is learned during the call from the probabilities read and the verdicts that follow
(`plan.confidence.LearnedThreshold`), as Transformers does where scikit-learn is installed.

Lossless and exact: the decision to draft deeper reads only tokens already drafted and earlier steps' verdicts,
never whether one of this step's tokens is kept, so the verifier sees a chain the draft proposed as usual
(`SizedShapeDrafter` stops levels on the same argument).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.tree import TokenTree
from ..core.verdict import Verdict
from ..plan.confidence import LearnedThreshold
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
        adapt: bool = False,
    ) -> None:
        super().__init__(draft_model, shape, logits_processor, child_selection, generator, vocab)
        self.threshold = threshold  # 0 < threshold < 1: ChainConfig drafts the whole chain for 0
        self.learned = LearnedThreshold(threshold) if adapt else None
        self._read_probs: list[float] = []  # the step's drafted tokens' draft probabilities read, root side first
        self._tokens: torch.Tensor | None = None  # the step's tokens (-1 where not drafted yet), filled level by level
        self._last_logq: Callable[[], torch.Tensor] | None = None  # the last level's draft log-probabilities, (1, 1)
        self._read: list[int] | None = None  # the drafted tokens, read with the decision that stopped the chain

    def _step_started(self, tokens: torch.Tensor) -> None:
        self._tokens, self._last_logq, self._read, self._read_probs = tokens, None, None, []

    def _level_drafted(self, level: ShapeLevel, kids: torch.Tensor, logq: Callable[[], torch.Tensor]) -> None:
        self._last_logq = logq  # computed only if a deeper level is asked about

    def _level_pays(self, index: int) -> bool:
        if self._last_logq is None:
            return True
        log_prob, tokens = read_with_tokens(self._last_logq()[0, 0], self._tokens)  # -inf: no child
        self._read_probs.append(math.exp(log_prob))
        if self._read_probs[-1] < self.threshold:
            self._read = tokens
            return False
        return True

    def _read_tokens(self, tokens: torch.Tensor) -> list[int]:
        return self._read if self._read is not None else tokens.tolist()

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        super().accept(input_ids, tree, verdict)
        if self.learned is not None:
            self.learned.observe(self._read_probs, len(verdict.path) - 1)
            self.threshold = self.learned.threshold
