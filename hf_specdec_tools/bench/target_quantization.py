"""Quantized targets through Transformers' own routes, and the automatic choice of the fastest one on this machine.

A CPU pass over a few tokens is bound by the weight bytes it reads, so a target with int8 weights should make every
pass cheaper, plain or speculative. Each route here is a `quantization_config=` that `from_pretrained` takes (torchao
through `TorchAoConfig`), so the model a user loads the same way is the one measured. Speculation stays lossless
against plain `generate` on the same quantized target: only the target decides.

Every route here computes each token's row on its own (weights quantized, activations per token or not at all), so
a tree pass gives each node the logits a single-token pass would. Not offered, and why (measured, see README):
PyTorch's dynamic int8 (`quantize_draft`) quantizes a pass's activations with one scale for all its rows, so a
token's logits depend on the tree it is verified in (fine for a draft, not lossless for a target); torchao 0.18 has
no int4 layout for CPUs (its int4 formats are GPU kernels); Transformers keeps GGUF weights packed only on GPUs;
optimum-quanto's int8 (`QuantoConfig`) was measured and lost to the prepacked bfloat16 target with speculation.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_specdec.plan.latency import measure_latency


@dataclass(frozen=True)
class QuantizationRoute:
    name: str
    description: str
    package: str  # import name it needs
    extra: str  # pip requirement that provides it
    config: Callable[[], Any]  # -> a transformers quantization config

    def unavailable(self) -> str | None:
        """Why this route cannot run here, or None."""
        if importlib.util.find_spec(self.package) is None:
            return f"{self.package} is not installed (pip install {self.extra})"
        return None


def _torchao(kind: str) -> Callable[[], Any]:
    def build() -> Any:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        configs = {"int8": Int8WeightOnlyConfig, "int8-dynamic": Int8DynamicActivationInt8WeightConfig}
        return TorchAoConfig(quant_type=configs[kind]())

    return build


ROUTES: dict[str, QuantizationRoute] = {
    "int8": QuantizationRoute("int8", "torchao int8 weight-only (TorchAoConfig)", "torchao", "torchao",
                              _torchao("int8")),
    "int8-dynamic": QuantizationRoute("int8-dynamic", "torchao int8 weights and dynamically quantized int8 "
                                      "activations (TorchAoConfig)", "torchao", "torchao", _torchao("int8-dynamic")),
}
CHOICES = ("none", "auto", *ROUTES)


def quantization_config(name: str) -> Any:
    """The `quantization_config=` of route `name`; a clear error when it cannot run here."""
    route = ROUTES.get(name)
    if route is None:
        raise ValueError(f"Unknown target quantization {name!r}: choose one of {', '.join(CHOICES)}.")
    why = route.unavailable()
    if why is not None:
        raise ImportError(f"--quantize-target {name} cannot run here: {why}.")
    return route.config()


def available_routes() -> list[str]:
    return [name for name, route in ROUTES.items() if route.unavailable() is None]


def fastest_route(
    load: Callable[[str | None], PreTrainedModel], candidates: Sequence[str | None], sizes: tuple[int, ...] = (1, 16),
    progress: bool = True,
) -> tuple[str | None, PreTrainedModel, dict[str, dict[int, float]]]:
    """Load the target through each candidate route (None: unquantized) and keep the one whose passes over 1 and 16
    tokens (a plain step and a typical tree) take least time on this machine; the others are freed.

    Returns (route, model, {route or "none": {tokens: ms per pass}}).
    """
    best: tuple[str | None, PreTrainedModel, float] | None = None
    timings: dict[str, dict[int, float]] = {}
    for route in tqdm(candidates, desc="timing target quantizations", unit="route", disable=not progress):
        model = load(route)
        curve = measure_latency(model, sizes, past_length=64, repeats=2, progress=False, stop_ratio=None)
        timings[route or "none"] = {n: round(s * 1000, 1) for n, s in zip(curve.sizes, curve.seconds)}
        if best is None or sum(curve.seconds) < best[2]:
            best = (route, model, sum(curve.seconds))
        del model
        gc.collect()
    assert best is not None, "no candidate route"
    return best[0], best[1], timings
