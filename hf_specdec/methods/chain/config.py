"""`speculation="chain"`: classic speculative decoding, one drafted chain per step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ...core.config import PlanRequest, register_speculation, set_by_with_plan
from ...draft.confident_chain import ConfidentChainDrafter
from ...draft.shaped_tree import ModelTreeDrafter
from ...plan.shape_sizing import level_cuts_menu
from ...plan.shapes import chain_parents
from ...runtime.model_info import vocab_size
from ..static_shape import StaticShapeConfig
from ..step_sized import PLAN_BUDGET

#: Transformers' `assistant_confidence_threshold` default: the stop where no cost model sizes the chain
TRANSFORMERS_THRESHOLD = 0.4


@register_speculation
@dataclass
class ChainConfig(StaticShapeConfig):
    """Classic speculative decoding: the draft proposes one chain per step, of up to `num_draft_tokens` tokens.

    With no `confidence_threshold` (and `per_step`, the default) the chain is sized every step by the cost model of
    `sequoia` and `tree` (plan/shape_sizing.py) with the pair's plan: each step drafts the chain length with the
    least predicted time per token, down to a plain step, and drafts one more token only while the kept tokens'
    learned acceptance (f(q), from the draft's probabilities and the verdicts so far) says it pays. A draft sure of
    tokens the target rejects stops sooner than a fixed probability would stop it. With a `confidence_threshold`
    (or `per_step=False`) the chain stops after the first token the draft gives less than it, as Transformers'
    assisted generation does (0.4 there and here).
    """

    method = "chain"
    drafts_chains = True
    num_draft_tokens: int = field(
        default=20, metadata={"help": "The most tokens drafted per step (chain length); 20, as Transformers' "
                              "num_assistant_tokens."})
    confidence_threshold: float | None = field(
        default=None,
        metadata={"help": "Stop a step's chain after a token the draft gives a probability below this (Transformers' "
                  "assistant_confidence_threshold): long chains where the draft is sure, short ones where it is not. "
                  "None (default): sized every step by the cost model (`per_step`), else 0.4 (Transformers' "
                  "default). 0: always num_draft_tokens. A batch drafts one length for all its rows: on while its "
                  "rows' chains, averaged, are at least this likely to go on (0.4 with None)."},
    )
    adapt_threshold: bool = field(
        default=False,
        metadata={"help": "Learn the threshold during the call, starting from confidence_threshold, as Transformers' "
                  "assisted generation does where scikit-learn is installed: after every step, the one that would "
                  "have cost least over the draft probabilities and verdicts seen so far (a rejected token drafted "
                  "on costs 1, a kept token stopped at 3; plan/confidence.py). Off by default: on a Zen 3 it cut "
                  "draft passes 15% and target-pass tokens 8% with no measurable gain, and deeper chains read the "
                  "host once per level. A batch keeps the threshold fixed. Not with the chain sized every step."},
    )
    per_step: bool = field(
        default=True,
        metadata={"help": "With no confidence_threshold: size the chain every step with the pair's plan (its "
                  "acceptance and latency curves; looked up, re-sized or calibrated as for 'sequoia'). False: stop on "
                  "the draft's confidence (0.4)."},
    )
    plan: Any = set_by_with_plan(
        None, "the pair's plan whose acceptance and latency curves size the chain every step; None stops on the "
        "draft's confidence."
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
        if not isinstance(self.per_step, bool):
            raise ValueError(f"per_step must be True or False, got {self.per_step!r}.")
        if self.adapt_threshold and self._sized():
            raise ValueError("adapt_threshold learns a confidence threshold, but this chain is sized every step by the "
                             "cost model: give a confidence_threshold to start from (Transformers' is 0.4), or "
                             "per_step=False.")

    def _sized(self) -> bool:
        return self.per_step and self.confidence_threshold is None

    def plan_request(self) -> PlanRequest | None:
        return PlanRequest(max_budget=PLAN_BUDGET) if self._sized() else None

    def with_plan(self, plan: Any, source: str) -> ChainConfig:
        resolved = dataclasses.replace(self)
        if getattr(plan, "profile", None) is not None:
            resolved.plan = plan
            resolved.plan_source = f"the chain sized every step with the acceptance and latency of {source}"
        return resolved

    def stop_below(self) -> float | None:
        threshold = TRANSFORMERS_THRESHOLD if self.confidence_threshold is None else self.confidence_threshold
        return float(threshold) if threshold else None  # 0 stops nothing

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> ModelTreeDrafter:
        if self.plan is not None:  # sized every step (`with_plan` found latency curves)
            return self.sized_drafter(self.plan, target, assistant_model, logits_processor,
                                      child_selection, generator)
        if self.stop_below() is None:  # the whole chain every step
            return super().make_drafter(target, assistant_model, logits_processor, child_selection, generator)
        return ConfidentChainDrafter(assistant_model, self.shape(), self.stop_below(), logits_processor,
                                     child_selection, generator, vocab_size(target), adapt=self.adapt_threshold)

    def shape_menu(self):
        """The chain's shorter chains, down to one drafted token (and the root alone)."""
        return level_cuts_menu(self.shape())

    def shape(self) -> list[int]:
        return chain_parents(self.num_draft_tokens)
