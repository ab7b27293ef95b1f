"""Cheap passes over a few tokens on a CPU: every Linear weight prepacked once in oneDNN's blocked layout.

A tree pass is a matrix product with a handful of rows (one per node). PyTorch's default CPU path serves it with
MKL (float32) or an unpacked oneDNN call (bfloat16) that re-blocks the weight on every call; on AMD CPUs MKL's
small-row float32 path is several times slower than one row. With the weight packed once, a pass over 1, 4 or 16
tokens streams the weights at memory speed (measured in docs/cpu-kernels-and-quantization.md, "What this hardware
rewards").

`prepack(model)` swaps each plain `nn.Linear` for a `PackedLinear` that holds the packed weight only (no extra
memory), measures a pass over 1 and over 16 tokens before and after, and keeps whichever is faster on this machine.
`unpack(model)` restores the `nn.Linear`s bit for bit; `state_dict()` and `save_pretrained` write the plain weights.
Greedy outputs of speculation stay identical to plain `generate` on the same (prepacked) model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ..plan.latency import measure_latency
from ..runtime.devices import KERNELS_ATTRIBUTE, execution_device, is_offloaded

#: rows the packed layout is tuned for: tree passes are a few to a few dozen tokens
BATCH_HINT = 16
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def kernels_tag(rows_hint: int = BATCH_HINT) -> str:
    """What a model packed for `rows_hint`-row passes reports as its kernels (`core.devices.kernels`): latency curves
    and saved plans are keyed by it, since another packing prices passes differently."""
    return "onednn-prepacked" + ("" if rows_hint == BATCH_HINT else f"-{rows_hint}-rows")


def can_prepack(model: PreTrainedModel) -> str | None:
    """None when `model` can be prepacked here, else why not (in words)."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    if execution_device(model).type != "cpu":
        return f"it runs on {execution_device(model)}, not the CPU"
    if is_offloaded(model):
        return "accelerate streams its weights from elsewhere on every pass"
    if not any(_packable(module) for module in model.modules()):
        unpackable = {module.weight.dtype for module in model.modules() if type(module) is nn.Linear}
        unpackable -= set(packable_dtypes())
        if unpackable:
            names = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in unpackable))
            return (f"oneDNN cannot pack {names} weights on this CPU (its bfloat16 path needs AVX-512 BW/VL/DQ or "
                    "AVX-NE-CONVERT); load the model in float32 to prepack it")
        return "it has no float32/bfloat16 nn.Linear layers (a quantized model?)"
    return None


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU, found by packing a small weight of each once (its bfloat16 path
    needs instructions that AVX2-only CPUs lack, and raises there)."""
    usable = []
    for dtype in PACKABLE_DTYPES:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), BATCH_HINT)
        except RuntimeError:
            continue
        usable.append(dtype)
    return tuple(usable)


def _packable(module: nn.Module) -> bool:
    """A plain float Linear on the CPU: not one whose weight is a quantized tensor subclass (torchao's report the
    float dtype they compute in), nor one accelerate moves weights into."""
    return (type(module) is nn.Linear and type(module.weight.data) is torch.Tensor
            and module.weight.dtype in packable_dtypes() and module.weight.device.type == "cpu"
            and getattr(module, "_hf_hook", None) is None)


class PackedLinear(nn.Module):
    """`nn.Linear` for inference whose weight lives in oneDNN's blocked layout, packed once."""

    def __init__(self, linear: nn.Linear, rows_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint),
                             persistent=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight (a copy): what code that inspects a Linear, and saving, expect."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed_weight.dtype:
            x = x.to(self.packed_weight.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                           dtype=self.packed_weight.dtype)
        linear.weight = nn.Parameter(self.weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "oneDNN-prepacked"


@dataclass(frozen=True)
class PrepackReport:
    """What `prepack` measured and decided (milliseconds per pass after 64 cached tokens)."""

    packed: bool
    reason: str
    before_ms: dict[int, float]
    after_ms: dict[int, float]


def _swap(model: nn.Module, replace) -> int:
    count = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            new = replace(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


def unpack(model: nn.Module) -> int:
    """Restore every `PackedLinear` of `model` to a plain `nn.Linear` (bit for bit); returns how many."""
    model.__dict__.pop(KERNELS_ATTRIBUTE, None)
    return _swap(model, lambda child: child.to_linear() if isinstance(child, PackedLinear) else None)


def is_prepacked(model: nn.Module) -> bool:
    return any(isinstance(module, PackedLinear) for module in model.modules())


def prepack(model: PreTrainedModel, measure: bool = True, sizes: tuple[int, ...] = (1, BATCH_HINT),
            rows_hint: int = BATCH_HINT) -> PrepackReport:
    """Prepack `model`'s Linear weights for this CPU, in place, if that makes its passes faster here.

    With `measure=True` (default) a pass over each of `sizes` tokens is timed before and after (a few seconds for a
    1.5B model) and the packing is undone unless their total got at least 5% faster; `measure=False` packs.
    `rows_hint`: the pass size oneDNN blocks the weights for (on Zen 3, 1 gave the cheapest one-token pass and dear
    tree passes: benchmarks/results/zen3/kernels/prepack-hints.json); latency curves and saved plans are keyed by it.
    """
    if rows_hint < 1:
        raise ValueError(f"rows_hint must be at least 1, got {rows_hint}.")
    why_not = can_prepack(model)
    if why_not is not None:
        return PrepackReport(False, f"not prepacked: {why_not}", {}, {})
    if is_prepacked(model):
        return PrepackReport(True, "already prepacked", {}, {})
    before = _time(model, sizes) if measure else {}
    with torch.no_grad():
        count = _swap(model, lambda child: PackedLinear(child, rows_hint) if _packable(child) else None)
    setattr(model, KERNELS_ATTRIBUTE, kernels_tag(rows_hint))  # latency curves measured before no longer apply
    after = _time(model, sizes) if measure else {}
    if measure and sum(after.values()) > 0.95 * sum(before.values()):
        unpack(model)
        return PrepackReport(False, "not prepacked: it was not faster on this CPU", before, after)
    return PrepackReport(True, f"prepacked {count} Linear layers in oneDNN's blocked layout", before, after)


def _time(model: PreTrainedModel, sizes: tuple[int, ...]) -> dict[int, float]:
    curve = measure_latency(model, sizes, past_length=64, repeats=3, progress=False, stop_ratio=None)
    return {n: round(seconds * 1000, 2) for n, seconds in zip(curve.sizes, curve.seconds)}
