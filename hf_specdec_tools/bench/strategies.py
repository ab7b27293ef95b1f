"""What each benchmarked strategy passes to `generate`: Transformers' own options and every registered method.

A strategy is written `NAME[:key=value,key=value]`. For hf_specdec methods the settings become
`speculation_config=`; for Transformers' baselines they are extra `generate` kwargs (e.g.
`hf-assisted:num_assistant_tokens=8,num_assistant_tokens_schedule=constant`). Values are JSON when they parse
as JSON (`widths=[4,2,1]`, `budget=128`, `verifier=greedy` stays a string).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from hf_specdec.core.config import SPECULATION_METHODS, SpeculationConfig, known_methods, make_config
from hf_specdec.core.releases import ASSISTED_ON_STATIC_CACHE, RELEASE

PLAIN = "plain"
HF_ASSISTED = "hf-assisted"
HF_ASSISTED_STATIC = "hf-assisted-static"
HF_PROMPT_LOOKUP = "hf-prompt-lookup"

#: Transformers' own decoding options: name -> (generate kwargs, needs the draft model)
BASELINES: dict[str, tuple[dict[str, Any], bool]] = {
    PLAIN: ({}, False),
    HF_ASSISTED: ({}, True),  # assistant_model=draft, Transformers' default adaptive schedule
    # the same on a static cache (Transformers 5.24 on), its verify pass compiled where plain's forward would be (a
    # GPU, or a compile_config with _compile_all_devices)
    **({HF_ASSISTED_STATIC: ({"cache_implementation": "static"}, True)} if ASSISTED_ON_STATIC_CACHE else {}),
    HF_PROMPT_LOOKUP: ({"prompt_lookup_num_tokens": 10}, False),
}

#: methods of the `--quick` preset, when registered (the rest of the registry is skipped to stay under 10 minutes;
#: `tree` is left out because `sequoia` is the same drafter with the tree shape planned for this hardware)
QUICK_METHODS = ("specexec", "sequoia", "staged")


class StrategyError(ValueError):
    """A `--strategy` spec that cannot run: the message names the problem and the fix."""


@dataclass
class Strategy:
    """One column of the benchmark: a name, its settings, and how they reach `generate`."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """`plain`, `transformers` (Transformers' own decoding options) or `hf_specdec` (a registered method)."""
        if self.name == PLAIN:
            return "plain"
        return "transformers" if self.name in BASELINES else "hf_specdec"

    @property
    def label(self) -> str:
        """The spec in canonical form: what tables, plots and results.json call this strategy."""
        if not self.settings:
            return self.name
        return f"{self.name}:" + ",".join(f"{key}={_format_value(value)}" for key, value in self.settings.items())

    @property
    def config_class(self) -> type[SpeculationConfig] | None:
        return SPECULATION_METHODS.get(self.name) if self.kind == "hf_specdec" else None

    @property
    def uses_draft(self) -> bool:
        if self.kind == "hf_specdec":
            return bool(self.config_class.needs_assistant)
        return BASELINES[self.name][1]

    def generate_kwargs(self, draft: PreTrainedModel | None) -> dict[str, Any]:
        """The kwargs this strategy adds to a plain `generate` call."""
        kwargs: dict[str, Any] = {}
        if self.uses_draft:
            if draft is None:
                raise StrategyError(f"Strategy {self.label!r} drafts with a model: load a draft (--draft).")
            kwargs["assistant_model"] = draft
        if self.kind == "hf_specdec":
            kwargs["speculation"] = self.name
            if self.settings:
                kwargs["speculation_config"] = dict(self.settings)
        else:
            kwargs.update(BASELINES[self.name][0])
            kwargs.update(self.settings)
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "name": self.name, "kind": self.kind, "settings": dict(self.settings),
                "uses_draft": self.uses_draft}


def known_strategies() -> list[str]:
    """Transformers' baselines, then every method registered right now (read from the registry, never a list), each
    once under its own name (aliases are accepted by `parse_strategy`, not listed)."""
    return [*BASELINES, *dict.fromkeys(cls.method for cls in SPECULATION_METHODS.values())]


def default_strategies() -> list[Strategy]:
    return [Strategy(name) for name in known_strategies()]


def quick_strategies() -> list[Strategy]:
    return [Strategy(name) for name in BASELINES] + [
        Strategy(name) for name in QUICK_METHODS if name in SPECULATION_METHODS
    ]


def parse_strategy(spec: str) -> Strategy:
    """`NAME[:key=value,...]` -> Strategy, checked against the registry and the method's settings."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name in SPECULATION_METHODS:
        name = SPECULATION_METHODS[name].method  # an alias names its method
    if name == HF_ASSISTED_STATIC and name not in BASELINES:
        raise StrategyError(f"{HF_ASSISTED_STATIC} needs Transformers 5.24 or newer (installed: {RELEASE}): "
                            "pip install -U transformers, or drop it.")
    if name not in known_strategies():
        raise StrategyError(
            f"Unknown strategy {name!r} in --strategy {spec!r}. Known strategies: {', '.join(BASELINES)}, "
            f"{known_methods()}."
        )
    settings = _parse_settings(spec, rest) if rest.strip() else {}
    strategy = Strategy(name, settings)
    _check_settings(strategy, spec)
    return strategy


def resolve_strategies(specs: list[str] | None, quick: bool = False) -> list[Strategy]:
    """The strategies to run, `plain` first (every figure is relative to it); duplicates are refused."""
    if specs:
        strategies = [parse_strategy(spec) for spec in specs]
    else:
        strategies = quick_strategies() if quick else default_strategies()
    labels = [s.label for s in strategies]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise StrategyError(f"Strategy {duplicates[0]!r} is given twice: give each --strategy once.")
    if PLAIN not in labels:
        strategies.insert(0, Strategy(PLAIN))  # the reference for speedups and identical outputs
    else:
        strategies.insert(0, strategies.pop(labels.index(PLAIN)))
    return strategies


def _parse_settings(spec: str, text: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for item in _split_top_level(text):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise StrategyError(
                f"Bad setting {item.strip()!r} in --strategy {spec!r}: write key=value pairs separated by commas, "
                "e.g. specexec:budget=128,width=4 or tree:widths=[4,2,1]."
            )
        if key in settings:
            raise StrategyError(f"Setting {key!r} is given twice in --strategy {spec!r}.")
        settings[key] = _parse_value(value.strip())
    return settings


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, braces and quotes, so `widths=[4,2,1],verifier=greedy` is two items."""
    items, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote and text[i - 1] != "\\" else quote
        elif char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _format_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _check_settings(strategy: Strategy, spec: str) -> None:
    if strategy.kind == "hf_specdec":
        try:
            make_config(strategy.name, strategy.settings)
        except (ValueError, TypeError) as error:
            raise StrategyError(f"--strategy {spec!r}: {error}") from None
        return
    if strategy.kind == "plain" and strategy.settings:
        raise StrategyError(f"--strategy {spec!r}: `plain` is the reference every figure is relative to; it "
                            "takes no settings.")
    defaults = GenerationConfig()
    unknown = sorted(key for key in strategy.settings if not hasattr(defaults, key))
    if unknown:
        raise StrategyError(
            f"--strategy {spec!r}: {unknown} are not generation settings of Transformers. Give `generate` "
            "kwargs such as num_assistant_tokens, num_assistant_tokens_schedule or prompt_lookup_num_tokens."
        )
