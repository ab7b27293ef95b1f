"""Speculation settings as dataclasses, one per method, registered by name (the way peft registers tuners).

A config is plain data: it validates its settings, says whether it needs a plan looked up for the call
(`plan_request`), takes the plan found (`with_plan`) and builds its drafter. Finding the plan (given, stored,
re-sized, calibrated) is a step of the integration, never a side effect of a config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from .drafter import Drafter

SPECULATION_METHODS: dict[str, type[SpeculationConfig]] = {}


@dataclass(frozen=True)
class PlanRequest:
    """A config's request for a plan: the Sequoia tree (and its acceptance vector and latency curves) for this
    model pair, temperature and hardware, looked up as given -> stored -> re-sized -> calibrated online."""

    given: Any = None  # a plan file path, dict or plan object the user passed; None: look one up
    max_budget: int = 128  # the largest tree a plan made now may have (nodes, root included)
    max_depth: int = 12  # the most levels a plan made now may have (root included)
    calibrate_online: bool = True  # with no stored plan: calibrate on the prompt (True) or raise (False)


def register_speculation(cls: type[SpeculationConfig]) -> type[SpeculationConfig]:
    """Class decorator: `speculation=cls.method` (or one of `cls.aliases`) now selects this config and its drafter."""
    for name in (cls.method, *cls.aliases):
        SPECULATION_METHODS[name] = cls
    return cls


def set_by_with_plan(default: Any, help: str) -> Any:
    """A field `with_plan` sets on the config it resolves, declared (with `help`) but not a setting: no `__init__`
    argument, left out of `settings()`, `to_dict` and generation_config.json, of repr and of ==."""
    return field(default=default, init=False, repr=False, compare=False,
                 metadata={"help": f"Set by `with_plan`, not a setting: {help}"})


@dataclass
class SpeculationConfig:
    """Settings shared by every method. Subclasses add their own and build their drafter."""

    method: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()  # other names `speculation=` accepts for this method (older ones)
    needs_assistant: ClassVar[bool] = True
    #: every step drafts a chain (one token per level): it also runs on models with recurrent state
    drafts_chains: ClassVar[bool] = False
    #: how this method's drafter can pick children (see logits/child_selection.py); sampling verifiers need
    #: children drawn from the draft distribution, so deterministic drafters accept only greedy and target_sample
    child_selections: ClassVar[tuple[str, ...]] = ("top_k",)
    #: the verifier used when sampling and none is named: the best-accepting exact one for this drafter
    default_sampling_verifier: ClassVar[str] = "target_sample"
    verifier: str | None = field(
        default=None,
        metadata={
            "help": "Verifier name (see hf_specdec.VERIFIERS). Default: greedy when not sampling, else the "
            "best exact verifier for this drafter."
        },
    )

    guard: bool = field(
        default=True,
        metadata={
            "help": "Measure every step against plain decoding and run plain steps while speculation keeps losing "
            "(plan/guard.py). False: every step speculates (a fixed tree to benchmark, passes to count)."
        },
    )

    lean_target: bool | None = field(
        default=None,
        metadata={
            "help": "Run the target's eager tree passes through the lean pass (kernels/lean_pass.py: Llama, Qwen2, "
            "Mistral with sdpa attention): True, False, or None for off the CPU only, where an eager pass is bound "
            "by its host time."
        },
    )
    depth_first: bool | None = field(
        default=None,
        metadata={
            "help": "Hand the target its tree in depth-first order, so that the usual accepted path (first children) "
            "is kept without moving cache rows (runtime/pass_shapes.py): True, False, or None for off the CPU only."
        },
    )

    plan_source: str = set_by_with_plan(
        "", "where a plan or size came from (stats and logs say it; never guessed silently). Empty for a config that "
        "took no plan."
    )

    def make_drafter(
        self,
        target: PreTrainedModel,
        assistant_model: PreTrainedModel | None,
        logits_processor: LogitsProcessorList,
        child_selection: str,
        generator: torch.Generator | None,
    ) -> Drafter:
        raise NotImplementedError

    def validate(self) -> None:
        """Raise ValueError naming a bad setting and its fix."""

    def batch_refusal(self) -> tuple[str, str] | None:
        """(what, fix) where these settings cannot decode a batch (several sequences); None where they can."""
        return None

    def plan_request(self) -> PlanRequest | None:
        """What must be looked up for this call before drafting (a tree plan, latency curves), or None."""
        return None

    def with_plan(self, plan: Any, source: str) -> SpeculationConfig:
        """The config to draft with, given the plan the integration found for `plan_request()`; `source` says
        where it came from (stats and logs repeat it)."""
        raise NotImplementedError(f"{type(self).__name__} asked for a plan but does not take one.")

    def drafts(self) -> bool:
        """False when the prepared config drafts nothing (a plan that is the root alone: no tree pays on this
        hardware); generate then decodes exactly as plain `generate` does."""
        return True

    def to_dict(self) -> dict[str, Any]:
        names = {f.name for f in settings(self)}
        return {"method": self.method, **{k: v for k, v in dataclasses.asdict(self).items() if k in names}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculationConfig:
        data = dict(data)
        method = data.pop("method", cls.method or None)
        return make_config(method, data)


#: the prompt tokens a draft model reads by default (its last ones): on a Zen 5, code prompts of 2,600-3,400 tokens
#: decoded 1.2-1.3x faster with the draft given their last 1,024 than with all of them, at the same tokens per step;
#: the last 256 cost acceptance (`benchmarks/results/zen5/draft-window`). Prompts up to this long are read whole.
DRAFT_WINDOW = 1024


@dataclass
class ModelDraftConfig(SpeculationConfig):
    """Settings shared by the methods that draft with a model (`assistant_model=`)."""

    draft_window: int | None = field(
        default=None,
        metadata={
            "help": f"The most prompt tokens the draft model reads (the prompt's last ones; later tokens always). "
            f"Default: {DRAFT_WINDOW} for one sequence (a batch's drafts read whole prompts); 0: the whole prompt. "
            "A draft's pass over a long prompt, and each later pass attending to it, cost time; output is unchanged."
        },
    )

    def window_tokens(self) -> int | None:
        """What the draft reads of a single sequence's prompt: its last this many tokens (None: all)."""
        window = DRAFT_WINDOW if self.draft_window is None else self.draft_window
        return window or None

    def batch_refusal(self) -> tuple[str, str] | None:
        if self.draft_window:
            return "draft_window", "drop draft_window (a batch's drafts read whole prompts)"
        return None


def check_draft_window(config: SpeculationConfig) -> None:
    """Raise ValueError unless `config`'s draft_window (where it has one) is None or a whole number >= 0."""
    window = getattr(config, "draft_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"draft_window must be a number of tokens >= 1, 0 (the whole prompt) or None (the default, "
                         f"{DRAFT_WINDOW}), got {window!r}.")


def settings(config: SpeculationConfig | type[SpeculationConfig]) -> list[dataclasses.Field]:
    """The fields a user sets (`speculation=` settings, `to_dict`, generation_config.json); not the ones `with_plan`
    sets (declared with `init=False`: `plan_source`, a resolved config's plan or latency curves)."""
    return [f for f in dataclasses.fields(config) if f.init]


def known_methods() -> str:
    """The registered method names, each alias next to its method."""
    methods = sorted({cls.method: cls for cls in SPECULATION_METHODS.values()}.items())
    return ", ".join(f"{name!r}" + (f" (alias {', '.join(map(repr, cls.aliases))})" if cls.aliases else "")
                     for name, cls in methods)


def make_config(
    speculation: str | SpeculationConfig | dict, overrides: dict[str, Any] | None = None
) -> SpeculationConfig:
    """Turn what the user passed as `speculation=` (a name, a config or a dict) into a validated config."""
    overrides = dict(overrides or {})
    if isinstance(speculation, SpeculationConfig):
        config = dataclasses.replace(speculation, **overrides) if overrides else speculation
    elif isinstance(speculation, dict):
        return make_config(
            speculation.get("method"), {**{k: v for k, v in speculation.items() if k != "method"}, **overrides}
        )
    elif isinstance(speculation, str):
        if speculation not in SPECULATION_METHODS:
            raise ValueError(f"Unknown speculation {speculation!r}. Known methods: {known_methods()}.")
        config_cls = SPECULATION_METHODS[speculation]
        names = {f.name for f in settings(config_cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(
                f"speculation={speculation!r} has no setting(s) {unknown}. Its settings are: {sorted(names)}."
            )
        config = config_cls(**overrides)
    else:
        raise TypeError(
            f"`speculation` must be a method name ({known_methods()}), a SpeculationConfig or a dict, "
            f"not {type(speculation).__name__}."
        )
    for name in ("guard", "captured"):
        if not isinstance(getattr(config, name, False), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}.")
    for name in ("lean_target", "depth_first"):
        if getattr(config, name) not in (None, True, False):
            raise ValueError(f"{name} must be True, False or None (the running device decides), got "
                             f"{getattr(config, name)!r}.")
    check_draft_window(config)
    config.validate()
    return config
