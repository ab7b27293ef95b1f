"""Load the benchmarked target and draft: the embedded pair by default, or folders / Hub ids, the target optionally
disk-offloaded with accelerate (the setting where SpecExec's large trees pay off)."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from hf_specdec.kernels import frequent_tokens, quantize_draft, restrict_vocabulary
from hf_specdec.kernels.quantize import default_scheme
from hf_specdec.runtime.model_info import quantization

from .machine_choices import machine_key, recall, remember
from .target_quantization import ROUTES, automatic_routes, fastest_route, quantization_config

#: RAM given to the offloaded target by default, as a share of its weights. accelerate counts the (tied) embedding
#: against it and reserves room for the largest layer, so half the bytes keeps about a quarter of the layers in RAM;
#: the rest are read from disk on every pass. A quarter would put the whole model on disk.
DEFAULT_OFFLOAD_FRACTION = 0.5


@dataclass
class LoadedModels:
    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: Any
    info: dict[str, Any] = field(default_factory=dict)  # names, parameter counts, offload settings (results.json)
    cleanup: Callable[[], None] = lambda: None  # removes the offload folder


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters as loaded: count before prepacking or dynamic quantization, which move weights into buffers."""
    return sum(p.numel() for p in model.parameters())


def _source(name: str | None, role: str) -> tuple[str, str]:
    """(folder or Hub id to load, human name); None means the embedded default model of `role`."""
    if name is not None:
        return name, name
    from .. import models

    spec = models.DEFAULT_TARGET if role == "target" else models.DEFAULT_DRAFT
    return str(models.fetch(spec)), spec.title


def weight_bytes(source: str, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in `dtype`, from its config alone (no weights loaded)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    return parameter_count(model) * torch.tensor([], dtype=dtype).element_size()


def parse_memory(text: str) -> int:
    """`900MiB`, `1.5GB`, `2GiB` or a byte count -> bytes (accelerate's own parser)."""
    from accelerate.utils import convert_file_size_to_int

    try:
        value = int(text) if text.strip().isdigit() else convert_file_size_to_int(text.strip())
    except ValueError:
        raise ValueError(
            f"--offload-max-memory {text!r} is not a size: write e.g. 900MiB, 2GiB or a number of bytes."
        ) from None
    if value <= 0:
        raise ValueError(f"--offload-max-memory must be positive, got {text!r}.")
    return value


def offload_kwargs(source: str, dtype: torch.dtype, max_memory: str | None) -> tuple[dict[str, Any], str]:
    """from_pretrained kwargs that keep `max_memory` of the target in RAM and the rest on disk; (kwargs, folder)."""
    budget = parse_memory(max_memory) if max_memory else int(weight_bytes(source, dtype) * DEFAULT_OFFLOAD_FRACTION)
    folder = tempfile.mkdtemp(prefix="hf-specdec-offload-")
    return {"device_map": "auto", "max_memory": {"cpu": budget}, "offload_folder": folder}, folder


def _prepack(model: PreTrainedModel, decided: bool | None = None) -> dict[str, Any]:
    """Prepack `model` where it measures faster; `decided` (what an earlier run measured on this machine) skips the
    measuring."""
    from hf_specdec.kernels import prepack

    if decided is False:
        return {"prepacked": False, "reason": "not prepacked: measured no faster on this machine before",
                "ms_before": None, "ms_after": None}
    report = prepack(model, measure=decided is None)
    reason = report.reason if decided is None else f"{report.reason}, as measured on this machine before"
    return {"prepacked": report.packed, "reason": reason, "ms_before": report.before_ms or None,
            "ms_after": report.after_ms or None}


def load_models(
    target: str | None = None,
    draft: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    need_draft: bool = True,
    offload: bool = False,
    offload_max_memory: str | None = None,
    int8_draft: bool = False,
    prepack: bool = False,
    quantize_target: str | None = None,
    progress: bool = True,
    remeasure: bool = False,
    draft_vocabulary: int | None = None,
    draft_scheme: str = "auto",
) -> LoadedModels:
    """Target, draft (when a strategy needs one; with `int8_draft`, quantized by `quantize_draft` with `draft_scheme`:
    by default "mixed" on a CPU with native bfloat16, else dynamic int8) and the tokenizer; with
    `prepack`, both models' Linear weights prepacked for this CPU where that measures faster (hf_specdec.prepack);
    with `quantize_target`, the target loaded through that route of `target_quantization.ROUTES`. What the automatic
    choices (`auto` route, prepacking) measured is remembered per machine (`machine_choices`) and reused unless
    `remeasure`. With `draft_vocabulary` K, the draft's output layer covers the K tokens most frequent in
    `prompts.held_out_corpus` only (`hf_specdec.restrict_vocabulary`; with `int8_draft`, before quantizing)."""
    if (target is None) != (draft is None) and need_draft:
        raise ValueError(
            "Give both --target and --draft (a draft sharing the target's tokenizer), or neither for the embedded "
            "Qwen2.5-Coder 1.5B/0.5B pair."
        )
    if quantize_target not in (None, "none") and offload:
        raise ValueError(
            "--quantize-target cannot be combined with --offload: Transformers 5.23 failed to load a torchao-quantized "
            "model with weights on disk on a CPU-only machine (its loader asks for CUDA), and the pair is untested on "
            "GPUs. Quantize the target or offload it."
        )
    if quantize_target not in (None, "none", "auto"):
        quantization_config(quantize_target)  # fails now, before any loading, if the route cannot run here
    target_source, target_name = _source(target, "target")
    kwargs: dict[str, Any] = {}
    folder = None
    if offload:
        kwargs, folder = offload_kwargs(target_source, dtype, offload_max_memory)

    kernels: dict[str, Any] = {}
    counts: dict[str, int] = {}
    target_kernels: dict[str | None, dict[str, Any]] = {}  # per candidate route
    scheme = default_scheme() if draft_scheme == "auto" else draft_scheme
    quantized = (scheme if scheme != "dynamic-int8" else True) if int8_draft else False
    key = machine_key(f"{target_source}|{draft}|int8={quantized}|vocabulary={draft_vocabulary}|offload={offload}",
                      dtype)
    known = {} if remeasure or not (prepack or quantize_target == "auto") else (recall(key) or {})
    if quantize_target == "auto" and known.get("route", "none") not in ("none", *automatic_routes()):
        known = {}  # remembered from before `auto` left that route out (int8-dynamic): measure again
    packed = known.get("prepacked", {})

    def load_target(route: str | None) -> PreTrainedModel:
        extra = {} if route is None else {"quantization_config": quantization_config(route)}
        model = AutoModelForCausalLM.from_pretrained(target_source, dtype=dtype, **kwargs, **extra).eval()
        counts["target"] = parameter_count(model)
        if prepack:  # every candidate competes in its fastest form (prepacking skips quantized layers)
            same = (route or "none") == known.get("route", "none")  # what was measured applies to this route
            target_kernels[route] = _prepack(model, packed.get("target") if same else None)
        return model

    route_timings = None
    try:
        if quantize_target == "auto" and "route" in known:
            route = None if known["route"] == "none" else known["route"]
            target_model = load_target(route)
        elif quantize_target == "auto":
            route, target_model, route_timings = fastest_route(load_target, [None, *automatic_routes()],
                                                                  progress=progress)
        else:
            route = None if quantize_target in (None, "none") else quantize_target
            target_model = load_target(route)
        if route in target_kernels:
            kernels["target"] = target_kernels[route]
        draft_model, draft_name = None, None
        if need_draft:
            draft_source, draft_name = _source(draft, "draft")
            draft_model = AutoModelForCausalLM.from_pretrained(draft_source, dtype=dtype).eval()
            counts["draft"] = parameter_count(draft_model)
        tokenizer = AutoTokenizer.from_pretrained(target_source)
        if draft_model is not None:
            vocabulary = None
            if draft_vocabulary:
                from ..prompts import held_out_corpus

                vocabulary = frequent_tokens(tokenizer, held_out_corpus(), draft_vocabulary)
            if int8_draft:
                draft_model = quantize_draft(draft_model, vocabulary=vocabulary, scheme=scheme)
            elif vocabulary is not None:
                restrict_vocabulary(draft_model, vocabulary)
        if prepack and draft_model is not None:
            kernels["draft"] = _prepack(draft_model, packed.get("draft"))
    except Exception:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    info: dict[str, Any] = {
        "target": {"name": target_name, "source": target_source, "parameters": counts["target"]},
        "draft": None
        if draft_model is None
        else {"name": draft_name, "source": draft_source, "parameters": counts["draft"]},
        "dtype": str(dtype).removeprefix("torch."),
        "draft_quantization": None if draft_model is None else quantization(draft_model),
        "target_quantization": {
            "route": route or "none", "requested": quantize_target or "none",
            "description": ROUTES[route].description if route else "unquantized",
            "weights": quantization(target_model), "ms_per_pass_by_route": route_timings},
        "offload": None,
        "kernels": kernels,
    }
    if prepack or quantize_target == "auto":
        choices = {**known, "prepacked": {role: report["prepacked"] for role, report in kernels.items()}}
        if quantize_target == "auto":
            choices["route"] = route or "none"
        remember(key, choices)
        info["remembered"] = known.get("measured")  # when these choices were measured, if not in this run
    if offload:
        places = Counter(str(place) for place in (getattr(target_model, "hf_device_map", None) or {}).values())
        info["offload"] = {"max_memory_bytes": kwargs["max_memory"]["cpu"], "modules_per_place": dict(places)}
    cleanup = (lambda: shutil.rmtree(folder, ignore_errors=True)) if folder else (lambda: None)
    return LoadedModels(target_model, draft_model, tokenizer, info, cleanup)
