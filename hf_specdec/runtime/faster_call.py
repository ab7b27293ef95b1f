"""A compiled forward used only for the pass sizes where it measured faster than the eager one, on this machine.

Compiling pays on a GPU (CUDA graphs remove the launch overhead of every kernel) and, on some CPUs, a few percent;
on others (an AVX2-only Zen 3 in float32) inductor makes a pass no faster and a compiled speculative call slower
than the eager one. So the first pass of each padded size on a static cache is a trial: after a warm-up pass (which
compiles), the eager and the compiled call each run the same pass `TRIALS` times, the cache's write length rewound
between runs, and the faster by the best run (the compiled one only if faster by `MARGIN`) runs that size from then
on. Choices are kept per model and compiled call for the process, as the graphs are. Outputs do not depend on the
choice beyond rounding: both calls compute the same pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from transformers.cache_utils import StaticLayer

from ..core.releases import given_cache

# The compiled call must be this much faster in the trial to be kept. On a CPU a trial of alternating passes is off
# by several percent from whole calls (Zen 3, float32, the real target's 8-node pass: compiled 1.33 s against eager
# 1.43 alternating, 1.32 against 1.22 inside whole calls); on a GPU CUDA graphs make it 2-3x faster.
MARGIN = 0.10
TRIALS = 3  # timed runs of each call per size (the best counts)
# Dynamo compiles at most `recompile_limit` (8) graphs of one function and then runs it eagerly, with a warning. In
# Transformers every model's forward is the same decorator's wrapper, so a process that compiles a target and a draft
# at a few padded sizes each, or tries two methods, reaches 8, and its later sizes run eagerly. Sizes come from a few
# buckets per model, so a new size's warm-up may compile up to this many graphs of that function.
GRAPHS_PER_FUNCTION = 64


class FasterCall:
    """Calls `model` or `compiled` (its compiled call) for a pass, whichever measured faster at that pass's size.

    Every call must pass the cache (under `releases.CACHE`; a static cache: the trial rewinds its write length) and
    `input_ids` (their length is the size). `trials` lists `(size, eager seconds, compiled seconds)` of this object's
    trials.
    """

    def __init__(self, model: torch.nn.Module, compiled: Callable, device: torch.device) -> None:
        self.model, self.compiled, self.device = model, compiled, torch.device(device)
        known = getattr(model, "_hf_specdec_compiled_sizes", None)  # kept with the model, as its compiled call is
        if known is None or known[0] is not compiled:
            known = model._hf_specdec_compiled_sizes = (compiled, {})
        self.choice: dict[int, bool] = known[1]  # size -> whether the compiled call runs it
        self.trials: list[tuple[int, float, float]] = []

    def __call__(self, **inputs: Any):
        size = inputs["input_ids"].shape[1]
        if size in self.choice:
            return (self.compiled if self.choice[size] else self.model)(**inputs)
        return self._trial(size, inputs)

    def kept_eager(self) -> set[int]:
        """The sizes that run eagerly because the compiled call measured no faster."""
        return {size for size, compiled in self.choice.items() if not compiled}

    def _trial(self, size: int, inputs: dict[str, Any]):
        layers = [layer for layer in given_cache(inputs).layers if isinstance(layer, StaticLayer)]
        limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_FUNCTION)
        with torch._dynamo.config.patch(recompile_limit=limit):
            self.compiled(**inputs)  # the warm-up: compiles this size
        starts = [layer.cumulative_length - size for layer in layers]  # before the pass (device tensors, no read)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for compiled in [False, True] * TRIALS:
            for layer, start in zip(layers, starts):
                layer.cumulative_length.copy_(start)
            _synchronize(self.device)
            began = time.perf_counter()
            out = (self.compiled if compiled else self.model)(**inputs)
            _synchronize(self.device)
            seconds[compiled].append(time.perf_counter() - began)
        eager, compiled = min(seconds[False]), min(seconds[True])
        self.choice[size] = compiled < eager * (1 - MARGIN)
        self.trials.append((size, eager, compiled))
        return out  # the compiled call's pass: the last one run, whose rows the cache holds


def compile_events(call: Callable | None) -> tuple[int, int]:
    """(graphs dynamo compiled, compile trials `call` ran) so far: a pass that changes either took longer than a
    pass, so cost models skip its time."""
    return counters["stats"]["unique_graphs"], len(getattr(call, "trials", ()))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

