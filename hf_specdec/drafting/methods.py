"""`speculation="chain"` and `speculation="tree"`: a draft model grows a fixed shape each step."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedModel
from transformers.utils import logging

from ..config import SpeculationConfig, register_speculation
from ..planning.sequoia import TreePlan
from ..planning.shapes import chain_parents, validate_parents, widths_parents
from .model_tree import ModelTreeDrafter

logger = logging.get_logger(__name__)

# Wide and shallow: on a 2-core CPU a 32-node target pass costs < 2 single-token passes, while each
# extra level costs a whole draft pass (DESIGN.md §4).
DEFAULT_TREE_WIDTHS = [4, 2, 1, 1]


class StaticShapeConfig(SpeculationConfig):
    """A method whose every step drafts the same tree shape with the assistant model."""

    child_selections = ("top_k", "without_replacement", "with_replacement")
    default_sampling_verifier = "sequoia"

    def shape(self) -> list[int]:
        raise NotImplementedError

    def drafts(self) -> bool:
        return len(self.shape()) > 1

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


@register_speculation
@dataclass
class SequoiaConfig(StaticShapeConfig):
    """`speculation="sequoia"`: the DP-optimal tree for this pair's measured acceptance, sized to this hardware.

    The plan comes from, in this order: `plan` when given; a plan stored for this model pair, dtype, device and
    temperature (saved on this machine, or shipped with the package for the embedded default pair); else a short
    online calibration on the current prompt, saved for next time. `speculation_stats.plan_source` says which.
    """

    method = "sequoia"
    plan: Any = field(
        default=None,
        metadata={"help": "A plan file from `hf-specdec calibrate`, a SequoiaPlan or TreePlan, a dict of either, or "
                  "None to look one up for this pair (then calibrate online)."},
    )
    calibrate_online: bool = field(
        default=True,
        metadata={"help": "When no plan is given or stored, calibrate on the current prompt (a few seconds) and save "
                  "the plan; False raises instead."},
    )
    max_budget: int = field(default=128, metadata={"help": "Largest tree (nodes, root included) online sizing tries."})
    max_depth: int = field(default=12, metadata={"help": "Most levels (root included) online sizing tries."})

    def validate(self) -> None:
        if isinstance(self.plan, (str, os.PathLike)) and not Path(self.plan).is_file():
            raise ValueError(
                f"Sequoia plan file {str(self.plan)!r} not found: give the path `hf-specdec calibrate --output` wrote, "
                "or drop `plan` to use a stored plan or calibrate online."
            )
        if self.plan is not None and not isinstance(self.plan, (str, os.PathLike, dict, TreePlan)):
            from ..calibration import SequoiaPlan

            if not isinstance(self.plan, SequoiaPlan):
                raise TypeError(f"`plan` must be a path, a dict, a SequoiaPlan or a TreePlan, not {type(self.plan)}.")
        for name in ("max_budget", "max_depth"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")

    def prepare(self, target, assistant_model, generation_config, input_ids) -> SequoiaConfig:
        from ..calibration.resolve import call_temperature, resolve_plan

        plan, source = resolve_plan(self.plan, target, assistant_model, call_temperature(generation_config), input_ids,
                                    self.max_budget, self.max_depth, self.calibrate_online)
        resolved = dataclasses.replace(self, plan=plan)
        resolved.plan_source = source
        logger.info(f"hf_specdec: speculation='sequoia' uses {source}.")
        return resolved

    def shape(self) -> list[int]:
        if self.plan is None or isinstance(self.plan, (str, os.PathLike, dict)):
            raise RuntimeError("SequoiaConfig.shape() needs a resolved plan: call prepare() first.")
        return list(self.plan.parents)
