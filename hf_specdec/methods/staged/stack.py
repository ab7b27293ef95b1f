"""The `stages` setting of `speculation="staged"`: parsed into stage specs, then built into a drafter stack.

`stages` lists what sits under `assistant_model`, most expensive first. Each entry is one of:

- `"prompt_lookup"` or `{"prompt_lookup": {...PromptLookupDrafter settings}}` (`"ngram"`, its older name, is an
  alias): prompt lookup over the prompt and the generated text;
- `{"ngram_model": "file.json", ...}` or an `NGramModel`: a Katz-backoff n-gram LM (`hf-specdec ngram train`);
- a causal LM sharing the vocabulary, or `{"model": lm, "budget": 12, ...}`: another model stage, with its own
  stages below it taken from the rest of the list;
- a list of n-gram entries (or `Drafter` objects): merged into one stage (the union of their trees).

Only model stages have a stage below them, so n-gram entries come last. `stages=[]` is the draft model alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ...core.drafter import Drafter
from ...runtime.attention import check_supported
from ...runtime.model_info import vocab_size, vocabulary_mismatch
from ..prompt_lookup.drafter import PromptLookupDrafter
from ..specexec.best_first import BestFirstDrafter
from .merged import MergedDrafter
from .ngram_model import NGramModel, NGramModelDrafter

DEFAULT_STAGES = ("prompt_lookup",)
LOOKUP_NAMES = ("prompt_lookup", "ngram")  # the prompt-lookup stage, and its older name
# Settings of stages below the draft model. Every lower node is forwarded by the stage above in its next pass, so
# lower trees stay small: a 16-token pass costs about one single-token pass on a CPU (`studies.latency_curves`).
# Lookups match two tokens at least: a one-token match finds a continuation after nearly every token of a long
# prompt, which the draft then forwards and rarely confirms (a retrieved-context chat: draft passes 2.8x as dear,
# the call 0.84x plain). On a Zen 4 (the real pair, one process, 19 prompts), medians over plain with one-token
# matches / two: general chat 1.32x / 1.59x, HumanEval 2.06x / 2.29x, code continuations 1.73x / 1.93x
# (benchmarks/results/zen4/staged-lookup-2026-12-07/).
LOOKUP_DEFAULTS = {"max_ngram": 3, "min_ngram": 2, "depth": 8, "max_nodes": 16, "max_matches": 16}
NGRAM_MODEL_DEFAULTS = {"width": 2, "depth": 6, "max_nodes": 12, "min_prob": 0.01}
MODEL_DEFAULTS = {"budget": 8, "max_depth": 8, "width": 2, "beams": 2, "max_passes": 2, "lower_leaves": 1,
                  "min_prob": 0.0}
MERGED_MAX_NODES = 24
KINDS = (*LOOKUP_NAMES, "ngram_model", "model")
FIX = ('Write stages as a list, most expensive first, e.g. ["prompt_lookup"], [{"ngram_model": "lm.json"}], '
       '[small_model, "prompt_lookup"] or [["prompt_lookup", {"ngram_model": "lm.json"}]] (one merged n-gram level).')


@dataclass
class StageSpec:
    """One parsed entry of `stages`: its kind, its source (a model, a file, an object) and its settings."""

    kind: str  # "prompt_lookup", "ngram_model", "model", "drafter" or "merged"
    source: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    parts: list[StageSpec] = field(default_factory=list)

    @property
    def is_leaf(self) -> bool:
        return self.kind != "model"


def _is_model(obj: Any) -> bool:
    return isinstance(obj, PreTrainedModel) or (isinstance(obj, torch.nn.Module) and hasattr(obj, "config"))


def _check_options(where: str, kind: str, options: dict[str, Any]) -> None:
    allowed = {"prompt_lookup": LOOKUP_DEFAULTS, "ngram_model": NGRAM_MODEL_DEFAULTS, "model": MODEL_DEFAULTS}[kind]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: a {kind!r} stage has no setting(s) {unknown}; its settings are {sorted(allowed)}.")
    for name, value in options.items():
        if name == "min_prob":
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{where}: min_prob must be a number in [0, 1), got {value!r}.")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")


def parse_stage(spec: Any, where: str) -> StageSpec:
    """One `stages` entry -> StageSpec, or a ValueError naming the entry, the problem and the fix."""
    if isinstance(spec, str):
        if spec in LOOKUP_NAMES:
            return StageSpec("prompt_lookup")
        hint = f' For a trained n-gram model write {{"ngram_model": {spec!r}}}.' if spec.endswith(".json") else ""
        raise ValueError(f"{where}: unknown stage {spec!r}; the only stage named by a string is 'prompt_lookup' "
                         f"(alias 'ngram').{hint} {FIX}")
    if isinstance(spec, NGramModel):
        return StageSpec("ngram_model", spec)
    if isinstance(spec, Drafter):
        return StageSpec("drafter", spec)
    if _is_model(spec):
        check_supported(spec, where)
        return StageSpec("model", spec)
    if isinstance(spec, dict):
        kinds = [k for k in KINDS if k in spec]
        if len(kinds) != 1:
            raise ValueError(f"{where}: a stage dict needs exactly one of the keys {list(KINDS)}, got keys "
                             f"{sorted(spec)}. {FIX}")
        kind, options = kinds[0], {k: v for k, v in spec.items() if k != kinds[0]}
        source = spec[kind]
        kind = "prompt_lookup" if kind in LOOKUP_NAMES else kind
        if kind == "prompt_lookup":
            if isinstance(source, dict):
                options, source = {**source, **options}, None
            elif source not in (True, None):
                raise ValueError(f"{where}: write a prompt-lookup stage as 'prompt_lookup' or "
                                 "{'prompt_lookup': {settings}}.")
        elif kind == "ngram_model" and not isinstance(source, (str, Path, NGramModel)):
            raise ValueError(f"{where}: 'ngram_model' takes a file path or an NGramModel, got {type(source).__name__}.")
        elif kind == "model" and not _is_model(source):
            raise ValueError(f"{where}: 'model' takes a causal LM object (sharing the target's vocabulary), got "
                             f"{type(source).__name__}.")
        _check_options(where, kind, options)
        if kind == "model":
            check_supported(source, where)
        if kind == "prompt_lookup":
            _check_ngram(where, {**LOOKUP_DEFAULTS, **options})
        if kind == "ngram_model" and not isinstance(source, NGramModel) and not Path(source).is_file():
            raise ValueError(f"{where}: no n-gram model file at {str(source)!r}. Train one with "
                             f"`hf-specdec ngram train --output {source}`, or fix the path.")
        return StageSpec(kind, source, options)
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"{where}: an empty merged stage; drop it, or list the n-gram stages to merge.")
        parts = [parse_stage(part, f"{where}[{i}]") for i, part in enumerate(spec)]
        if any(not part.is_leaf for part in parts):
            raise ValueError(f"{where}: a merged stage can only hold n-gram stages or drafters, not models: give a "
                             f"model stage its own entry of `stages`. {FIX}")
        return StageSpec("merged", parts=parts)
    raise ValueError(f"{where}: cannot use a {type(spec).__name__} as a stage. {FIX}")


def _check_ngram(where: str, options: dict[str, Any]) -> None:
    if options["min_ngram"] > options["max_ngram"]:
        raise ValueError(f"{where}: need min_ngram <= max_ngram, got {options['min_ngram']} > {options['max_ngram']}.")


def parse_stages(stages: Any) -> list[StageSpec]:
    """The `stages` setting -> StageSpecs, top first; n-gram stages only at the bottom."""
    if stages is None:
        stages = list(DEFAULT_STAGES)
    elif not isinstance(stages, (list, tuple)):
        stages = [stages]
    specs = [parse_stage(spec, f"stages[{i}]") for i, spec in enumerate(stages)]
    for i, spec in enumerate(specs[:-1]):
        if spec.is_leaf:
            raise ValueError(f"stages[{i}] is an n-gram stage, but stages[{i + 1}] comes after it: only model stages "
                             "draw on a stage below them. Order stages most expensive first and put n-gram stages last "
                             "(several of them at one level go in one list).")
    return specs


@lru_cache(maxsize=8)
def _load_ngram_model(path: str, mtime_ns: int, size: int) -> NGramModel:
    return NGramModel.load(path)


def load_ngram_model(source: str | Path | NGramModel) -> NGramModel:
    """An NGramModel from a path (loaded once per file version) or as given."""
    if isinstance(source, NGramModel):
        return source
    stat = Path(source).stat()
    return _load_ngram_model(str(Path(source).resolve()), stat.st_mtime_ns, stat.st_size)


def build_stage(spec: StageSpec, below: Drafter | None, target: PreTrainedModel,
                processors: LogitsProcessorList | None, where: str) -> Drafter:
    """The drafter of one stage; `below` is the stage under it (model stages only)."""
    if spec.kind == "prompt_lookup":
        return PromptLookupDrafter(**{**LOOKUP_DEFAULTS, **spec.options})
    if spec.kind == "ngram_model":
        return NGramModelDrafter(load_ngram_model(spec.source), **{**NGRAM_MODEL_DEFAULTS, **spec.options})
    if spec.kind == "drafter":
        return spec.source
    if spec.kind == "merged":
        return MergedDrafter([build_stage(p, None, target, processors, f"{where}[{i}]")
                              for i, p in enumerate(spec.parts)], MERGED_MAX_NODES)
    mismatch = vocabulary_mismatch(target, spec.source)
    if mismatch is not None:
        raise ValueError(f"{where}: this model's vocabulary differs from the target's ({mismatch}): every model of a "
                         "stack must share the target's tokenizer.")
    return BestFirstDrafter(spec.source, lower=below, logits_processor=processors, vocab=vocab_size(target),
                            **{**MODEL_DEFAULTS, **spec.options})


def build_stack(stages: Any, target: PreTrainedModel, processors: LogitsProcessorList | None) -> Drafter | None:
    """The drafter stack under the draft model (None for `stages=[]`), bottom stage built first."""
    specs = parse_stages(stages)
    below = None
    for i in range(len(specs) - 1, -1, -1):
        below = build_stage(specs[i], below, target, processors, f"stages[{i}]")
    return below
