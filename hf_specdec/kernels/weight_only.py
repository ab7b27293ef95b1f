"""Weight-only int4 and int8 Linear layers on PyTorch's own fused CPU kernels, for drafts.

A draft pass over a few tokens reads every weight once; fewer weight bytes should make it cheaper. PyTorch ships
fused CPU kernels that multiply bfloat16 activations by packed low-bit weights without materialising a float copy:
`aten._weight_int4pack_mm_for_cpu` (4-bit, asymmetric, one scale and zero per group of input features) and
`aten._weight_int8pack_mm` (8-bit, symmetric, one scale per output row). torchao 0.18 has no CPU layout for int4,
and its int8 weight-only tensor dequantizes the whole weight on every call, so these modules call the aten kernels
directly. Activations are never quantized: each row's result depends on that row only.
"""

from __future__ import annotations

import torch
from torch import nn

#: group sizes the CPU int4 kernel takes, largest first (fewer scales to read)
INT4_GROUP_SIZES = (128, 64, 32)
#: the int4 kernel takes output widths in multiples of this many (a layer of another width is padded with zero rows);
#: it packs whole blocks of 64 rows and a last block of any such multiple (`fused_int4.INT4_PACK_BLOCK`)
INT4_ROW_BLOCK = 16
#: the aten operators each width needs
KERNELS = {4: ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"), 8: ("_weight_int8pack_mm",)}


def weight_only_unavailable(bits: int) -> str | None:
    """Why the fused weight-only kernel for `bits` cannot run with this PyTorch build, or None."""
    missing = [name for name in KERNELS[bits] if not hasattr(torch.ops.aten, name)]
    return f"this PyTorch build has no aten.{missing[0]}" if missing else None


def int4_group_size(linear: nn.Linear) -> int | None:
    """The group size `linear` can be packed with for the int4 kernel, or None (its input width fits none)."""
    return next((g for g in INT4_GROUP_SIZES if linear.in_features % g == 0), None)


class Int4Linear(nn.Module):
    """`nn.Linear` with 4-bit weights (per-group min/max scaling), bfloat16 activations, for inference."""

    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        padded = -(-self.out_features // INT4_ROW_BLOCK) * INT4_ROW_BLOCK  # e.g. a vocabulary subset's head
        weight = torch.nn.functional.pad(linear.weight.detach().float(), (0, 0, 0, padded - self.out_features))
        weight = weight.reshape(padded, -1, group_size)
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-6) / 15
        levels = ((weight - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(padded, -1)
        # the kernel computes (level - 8) * scale + zero, so the zero is the group's minimum shifted by 8 levels
        zero = low + 8 * scale
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1))
        self.register_buffer("scales_and_zeros", torch.cat([scale, zero], -1).transpose(0, 1)
                             .to(torch.bfloat16).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)

    @classmethod
    def stacked(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One layer computing `parts` (same input width and group size, no padding rows inside) side by side: their
        packed weights and scales stacked along the output rows (`fused_int4.py` says when that is the same)."""
        stack = cls.__new__(cls)
        nn.Module.__init__(stack)
        stack.in_features, stack.group_size = parts[0].in_features, parts[0].group_size
        stack.out_features = sum(part.out_features for part in parts)
        stack.register_buffer("packed_weight", torch.cat([part.packed_weight for part in parts]))
        stack.register_buffer("scales_and_zeros", torch.cat([part.scales_and_zeros for part in parts], 1).contiguous())
        biases = [part.bias for part in parts]
        stack.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases).detach(), requires_grad=False)
        return stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, self.group_size,
                                                         self.scales_and_zeros)[:, :self.out_features]
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


class Int8Linear(nn.Module):
    """`nn.Linear` with 8-bit weights (symmetric, one scale per output row), bfloat16 activations, for inference."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(-1).clamp(min=1e-8) / 127
        self.register_buffer("weight_int8", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def to_weight_only(model: nn.Module, bits: int) -> int:
    """Replace `model`'s plain float `nn.Linear`s by `Int4Linear` (bits=4) or `Int8Linear` (bits=8), in place;
    returns how many. int4 leaves a layer whose input width no supported group size divides in bfloat16."""
    if bits not in (4, 8):
        raise ValueError(f"weight-only kernels exist for 4 and 8 bits, not {bits}.")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if bits == 8:
                setattr(parent, name, Int8Linear(child))
            elif (group := int4_group_size(child)) is not None:
                setattr(parent, name, Int4Linear(child, group))
            else:
                continue
            count += 1
    return count
