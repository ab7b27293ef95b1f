"""How long one forward pass over n new tokens takes on this machine: the curve every size choice reads.

A tree of n nodes costs the target one pass over n tokens, and each drafted level of w nodes costs the draft
one pass over w tokens. Those costs are anything but linear in n on real hardware (a 2-core CPU is memory bound
up to a few dozen tokens; an offloaded model pays its weight transfer whatever n is), so they are measured,
with the same additive tree mask and a filled KV cache, and interpolated in between.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..accept.kv_cache import crop
from ..core.releases import cache_arg
from ..core.tree import TokenTree
from ..runtime.attention import AttentionLayout
from ..runtime.devices import compute_devices, cpu_model, device_layout, execution_device, is_offloaded, kernels
from ..runtime.model_info import quantization
from ..runtime.paths import json_object

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
STOP_RATIO = 16.0  # see measure_latency


def dtype_name(model: PreTrainedModel) -> str:
    return str(model.dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    """What the kernels run on: the GPU's name, or the CPU's model and the instruction set torch uses on it.

    Latency curves differ by far more between CPUs than between runs: a CPU without native bfloat16 multiplies
    bfloat16 matrices row by row, so a tree costs as much as that many single-token passes.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def placement(model: PreTrainedModel) -> dict:
    """Everything besides the model that decides its latency curve: hardware, threads, dtype, offloading,
    kernels, weight quantization, and how many ranks or devices share it (`devices.device_layout`)."""
    device = execution_device(model)
    found = {
        "device": device.type,
        "hardware": device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "dtype": dtype_name(model),
        "offloaded": is_offloaded(model),
        "kernels": kernels(model),
    }
    weights = quantization(model)
    if weights is not None:  # plain models keep their old key
        found["quantization"] = weights
    spread = device_layout(model)
    if spread is not None:  # tensor-parallel ranks, a device map over several devices; one device keeps its key
        found["layout"] = spread
    return found


@dataclass(frozen=True)
class LatencyCurve:
    """Median seconds of one forward pass over `sizes[i]` new tokens, after `past_length` cached ones."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    past_length: int = 256

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("A latency curve needs one time per size, and at least one size.")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"Latency sizes must be distinct positive integers in increasing order: {self.sizes}.")
        bad = [t for t in self.seconds if not (math.isfinite(t) and t > 0)]  # `not` also catches NaN
        if bad:
            # a zero, negative or NaN time would make every tree look free (or worthless) to the planners
            raise ValueError(f"Latency times must be finite positive seconds, got {bad}: measure the curve again.")
        if self.past_length < 0:
            raise ValueError(f"A latency curve's past_length counts cached tokens, got {self.past_length}.")

    def __call__(self, n: float | np.ndarray) -> float | np.ndarray:
        """Seconds for n tokens: linear between measured sizes, linear in the last segment's slope beyond them.

        A pass over more tokens never costs less, so a measured bump (a page fault, a busy neighbour) is read as
        the cheapest time measured at that size or above: one noisy point must not steer the planners away.
        A whole number of tokens is read from a per-curve memo (the cost models ask for the same sizes every step).
        """
        if isinstance(n, (int, np.integer)):
            return _seconds_at(self, int(n))
        return self._interpolate(n)

    def _interpolate(self, n: float | np.ndarray) -> float | np.ndarray:
        sizes = np.asarray(self.sizes, float)
        seconds = np.minimum.accumulate(np.asarray(self.seconds, float)[::-1])[::-1]
        value = np.interp(n, sizes, seconds)
        if len(sizes) > 1:
            slope = max((seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]), 0.0)
            value = np.where(np.asarray(n) > sizes[-1], seconds[-1] + slope * (np.asarray(n) - sizes[-1]), value)
        return float(value) if np.ndim(value) == 0 else value

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "past_length": self.past_length}

    @classmethod
    def from_dict(cls, data: dict) -> LatencyCurve:
        data = json_object(data, "A latency curve")
        return cls(tuple(int(s) for s in data["sizes"]), tuple(float(t) for t in data["seconds"]),
                   int(data.get("past_length", 256)))


@functools.lru_cache(maxsize=65536)
def _seconds_at(curve: LatencyCurve, n: int) -> float:
    return float(curve._interpolate(n))


def measure_latency(
    model: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    past_length: int = 256,
    repeats: int = 3,
    progress: bool = True,
    desc: str | None = None,
    stop_ratio: float | None = STOP_RATIO,
    give_up: Mapping[int, float] | None = None,
) -> LatencyCurve:
    """Time `model` on n new tokens (a star tree under one root: the costliest mask shape) for each n in `sizes`.

    Each measurement restores the cache to `past_length` tokens first, so every pass sees the same context.
    Every size gets a warm-up pass and a first timing, smallest first; sizes stop once a pass costs more than
    `stop_ratio` times the smallest one: no tree that slow can pay for itself, and on hardware where cost grows with
    every token (bfloat16 on a CPU without native support) the largest sizes would take minutes. The curve
    extrapolates. The other `repeats - 1` timings run in rounds over every kept size, and each size keeps the median
    of its `repeats`: a slow spell of the machine (a busy neighbour) then lands on one timing of several sizes, not
    on every timing of one (timed size by size, one spell priced a 32-token pass on a 2-core Zen 3 at 1.76 s where
    its neighbours put it at 1.52, and steered 4-row batches away from 8-node trees).

    `give_up` (seconds per size): a first timing above its size's bound ends the measurement there, the curve
    holding the sizes timed so far. Comparing candidates (a target's quantization routes), one pass shows a route
    that is several times slower than the best so far; its full curve would cost minutes for nothing.
    """
    sizes = sorted({int(s) for s in sizes})
    device, dtype = execution_device(model), model.dtype
    layout = AttentionLayout.of(model)
    if layout.position_limit is not None:  # a learned position table: the star's leaves must still have a row
        past_length = min(past_length, layout.position_limit - 2)
    vocab = int(model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab // 4, vocab // 2, (1, past_length), generator=generator)
    cache = DynamicCache()  # full-length layers, so `crop` can restore the past whatever the model's window
    stars: dict[int, dict] = {}  # per size: its pass's inputs
    times: dict[int, list[float]] = {}  # per kept size: its timings
    bar = tqdm(total=len(sizes) * (repeats + 1), desc=desc or f"latency {type(model).__name__}", unit="pass",
               disable=not progress)

    def timed(n: int) -> float:
        start = time.perf_counter()
        model(**stars[n], **cache_arg(cache), use_cache=True)
        for place in compute_devices(model) if device.type == "cuda" else ():
            torch.cuda.synchronize(place)
        seconds = time.perf_counter() - start
        crop(cache, past_length)
        bar.update()
        return seconds

    with torch.no_grad(), bar:
        model(input_ids=prompt.to(device), **cache_arg(cache), use_cache=True, logits_to_keep=1)
        for n in sizes:
            star = TokenTree.from_parents(torch.randint(vocab // 4, vocab // 2, (n,), generator=generator),
                                          [-1] + [0] * (n - 1))  # every node descends from the first one
            stars[n] = {"input_ids": star.tokens[None].to(device),
                        "attention_mask": layout.tree_masks(star, past_length, dtype, device),
                        "position_ids": star.position_ids(past_length).to(device)}
            timed(n)  # warm-up
            times[n] = [timed(n)]
            if give_up is not None and times[n][0] > give_up.get(n, math.inf):
                return LatencyCurve(tuple(times), tuple(t[0] for t in times.values()), past_length)
            if stop_ratio is not None and len(times) > 1 and times[n][0] > stop_ratio * times[sizes[0]][0]:
                break
        bar.total = len(times) * (repeats + 1)  # the sizes cut off are not timed again
        bar.refresh()
        for _ in range(repeats - 1):  # the same order every round: a size's timings lie a round apart
            for n in times:
                times[n].append(timed(n))
    return LatencyCurve(tuple(times), tuple(statistics.median(t) for t in times.values()), past_length)
