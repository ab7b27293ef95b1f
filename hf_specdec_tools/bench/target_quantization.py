"""Quantized targets through Transformers' own routes, and the automatic choice of the fastest one on this machine.

A CPU pass over a few tokens is bound by the weight bytes it reads, so a target with int8 weights should make every
pass cheaper, plain or speculative. Each route here is a `quantization_config=` that `from_pretrained` takes (torchao
through `TorchAoConfig`), so the model a user loads the same way is the one measured. Speculation stays lossless
against plain `generate` on the same quantized target: only the target decides.

Speculation compares a one-token pass's logits with a tree pass's, row for row, so a route must not widen the gap
between the two beyond the unquantized model's own rounding. Int8 weights with bfloat16 activations (weight-only)
keep it; int8 activations (`int8-dynamic`) quantize each token's row on its own (a lone torchao Linear gives a row
bit for bit the same in a one-row and a ten-row pass), but a layer's input already differs by bfloat16 rounding
between the two passes (attention), and a rounding step of int8 turns that into whole quantization steps. Measured
on the real 1.5B target in bfloat16 (Intel Xeon with AMX, torch 2.13, torchao 0.18), logits of a 10-token pass
against ten one-token passes: unquantized 0.16 apart at most, int8 weight-only 0.19, int8-dynamic 1.03; greedy
`chain` and `specexec` then left plain's output on 2 of 3 demo prompts. So `auto` picks among the routes that keep
rows (`keeps_rows`); `int8-dynamic` runs only when asked for by name. Not offered, and why (measured, see docs/):
PyTorch's dynamic int8 (`quantize_draft`) quantizes a pass's activations with one scale for all its rows (fine for a
draft, not for a target); torchao 0.18 has no int4 layout for CPUs (its int4 formats are GPU kernels); Transformers
keeps GGUF weights packed only on GPUs; optimum-quanto's int8 (`QuantoConfig`) was measured and lost to the
prepacked bfloat16 target with speculation.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_specdec.plan.latency import LatencyCurve, measure_latency


@dataclass(frozen=True)
class QuantizationRoute:
    name: str
    description: str
    package: str  # import name it needs
    extra: str  # pip requirement that provides it
    config: Callable[[], Any]  # -> a transformers quantization config
    keeps_rows: bool  # a tree pass's rows stay within the unquantized model's rounding of one-token passes

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
                              _torchao("int8"), keeps_rows=True),
    "int8-dynamic": QuantizationRoute("int8-dynamic", "torchao int8 weights and dynamically quantized int8 "
                                      "activations (TorchAoConfig)", "torchao", "torchao", _torchao("int8-dynamic"),
                                      keeps_rows=False),
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


def automatic_routes() -> list[str]:
    """The routes `auto` may pick here: installed, and keeping a tree pass's rows as the unquantized model does."""
    return [name for name, route in ROUTES.items() if route.keeps_rows and route.unavailable() is None]


def fastest_route(
    load: Callable[[str | None], PreTrainedModel], candidates: Sequence[str | None], sizes: tuple[int, ...] = (1, 16),
    progress: bool = True, give_up_ratio: float = 2.0,
) -> tuple[str | None, PreTrainedModel, dict[str, dict[int, float]]]:
    """Load the target through each candidate route (None: unquantized) and keep the one whose passes over 1 and 16
    tokens (a plain step and a typical tree) take least time on this machine; the others are freed.

    The first candidate is timed whole; a later one stops at its first pass over more than `give_up_ratio` times the
    best's time at that size (int8 weight-only took 3.6 s a one-token pass on a Zen 4 against 0.14 s unquantized:
    timed whole, such routes cost a first `make demo` minutes). Its timings then hold the sizes reached.

    Returns (route, model, {route or "none": {tokens: ms per pass}}).
    """
    best: tuple[str | None, PreTrainedModel, LatencyCurve] | None = None
    timings: dict[str, dict[int, float]] = {}
    for route in tqdm(candidates, desc="timing target quantizations", unit="route", disable=not progress):
        model = load(route)
        bounds = None if best is None else {n: give_up_ratio * s for n, s in zip(best[2].sizes, best[2].seconds)}
        curve = measure_latency(model, sizes, past_length=64, repeats=2, progress=False, stop_ratio=None,
                                give_up=bounds)
        timings[route or "none"] = {n: round(s * 1000, 1) for n, s in zip(curve.sizes, curve.seconds)}
        if best is None or (curve.sizes == best[2].sizes and sum(curve.seconds) < sum(best[2].seconds)):
            best = (route, model, curve)
        del model
        gc.collect()
    assert best is not None, "no candidate route"
    return best[0], best[1], timings
