"""A draft Linear with two kernels, picked per pass by its row count: int4 weight-only for narrow passes, dynamic
int8 for wide ones.

Measured on Zen 4 over whole draft passes (`benchmarks/results/zen4/kernels/draft-kernels.json`): PyTorch's int4
weight-only kernel is the cheapest at one row (25.8 ms against dynamic int8's 30.8) but grows about linearly with the
rows (118 ms at 16 rows against 62): it suits a chain's one-token passes and loses on a tree's wide levels. A draft pays
for both kinds of pass every step (the catch-up pass and a tree's levels are wide, a chain's and a sized tree's first
levels are narrow), so each layer keeps both copies of its weights and a pass over at most `narrow_rows` rows takes
int4.
Either copy only changes what the draft proposes, never what the target keeps.
"""

from __future__ import annotations

import torch
from torch import nn

from .weight_only import Int4Linear, int4_group_size

#: the widest pass `quantize_draft(scheme="mixed")` tries on int4 (Zen 4: int4 wins at 1-2 rows, loses from 4)
MAX_NARROW_ROWS = 4


class RowDispatchLinear(nn.Module):
    """`nn.Linear` as two kernels: `narrow` (int4, bfloat16 activations) for passes of at most `narrow_rows` rows,
    `wide` (the float layer, quantized to dynamic int8 after this wrapper is put in) otherwise."""

    def __init__(self, linear: nn.Linear, group_size: int | None, narrow_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.narrow_rows = linear.in_features, linear.out_features, narrow_rows
        # no int4 copy where no group size divides the input width: every pass takes the wide kernel
        self.narrow = None if group_size is None else Int4Linear(linear, group_size)
        self.wide = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.narrow is not None and x.numel() <= self.narrow_rows * self.in_features:
            return self.narrow(x).to(x.dtype)
        return self.wide(x.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"int4 up to {self.narrow_rows} rows, else the wide kernel"


def split_by_rows(model: nn.Module, narrow_rows: int) -> int:
    """Wrap `model`'s plain float `nn.Linear`s in `RowDispatchLinear`s, in place (before quantizing `wide` to int8);
    returns how many have an int4 copy. Every layer is wrapped, so each int8 layer gets float32 activations even
    where the model computes in bfloat16 between layers."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                group = int4_group_size(child)
                setattr(parent, name, RowDispatchLinear(child, group, narrow_rows))
                count += group is not None
    return count


def set_narrow_rows(model: nn.Module, narrow_rows: int) -> None:
    """Move every `RowDispatchLinear`'s threshold (0: dynamic int8 only)."""
    for module in model.modules():
        if isinstance(module, RowDispatchLinear):
            module.narrow_rows = narrow_rows
