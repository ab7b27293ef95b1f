"""A draft Linear with up to three kernels, picked per pass by its row count: int4 weight-only for narrow passes,
dynamic int8 for wide ones, bfloat16 for the broadest (a prompt's pass) where this CPU multiplies bfloat16 faster.

Measured on Zen 4 over whole draft passes (`benchmarks/results/zen4/kernels/draft-kernels.json`): PyTorch's int4
weight-only kernel is the cheapest at one row (25.8 ms against dynamic int8's 30.8) but grows about linearly with the
rows (118 ms at 16 rows against 62): it suits a chain's one-token passes and loses on a tree's wide levels. A draft pays
for both kinds of pass every step (the catch-up pass and a tree's levels are wide, a chain's and a sized tree's first
levels are narrow), so each layer keeps both copies of its weights and a pass over at most `narrow_rows` rows takes
int4.

The broadest passes (the draft's pass over a prompt, hundreds of rows) are a third case. On a 2-core Xeon with AMX,
one of the 0.5B draft's MLP layers over 760 rows took 8.0 ms in dynamic int8 and 3.8 ms in bfloat16 (one row: 0.11
against 0.37 ms; level at about 64 rows), and the draft's pass over a 760-token retrieved context cost 1.5-1.7 s in
int8 against 0.8 s in bfloat16: the pass the call must repay before any step wins. So each layer of a "mixed" draft
also keeps its weights in bfloat16 (`broad`, 2 bytes a weight more), taken by passes of at least `broad_rows` rows,
the count measured on this machine from which bfloat16 is faster (`quantize.broad_rows_here`; 0: never).
Every copy only changes what the draft proposes, never what the target keeps.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from .weight_only import Int4Linear, int4_group_size

#: the widest pass `quantize_draft(scheme="mixed")` tries on int4 (Zen 4: int4 wins at 1-2 rows, loses from 4)
MAX_NARROW_ROWS = 4


class RowDispatchLinear(nn.Module):
    """`nn.Linear` as two or three kernels: `narrow` (int4, bfloat16 activations) for passes of at most `narrow_rows`
    rows, bfloat16 weights for passes of at least `broad_rows` rows (where kept, and `broad_rows` > 0), `wide` (the
    float layer, quantized to dynamic int8 after this wrapper is put in) otherwise."""

    def __init__(self, linear: nn.Linear, group_size: int | None, narrow_rows: int, broad: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.narrow_rows = linear.in_features, linear.out_features, narrow_rows
        # no int4 copy where no group size divides the input width: every pass takes the wide kernel
        self.narrow = None if group_size is None else Int4Linear(linear, group_size)
        self.broad_rows = 0  # set once measured (`set_broad_rows`)
        # buffers, not a Linear: dynamic quantization replaces every nn.Linear it finds, and this copy must stay
        bf16 = None if not broad else linear.weight.detach().to(torch.bfloat16).clone()
        self.register_buffer("broad_weight", bf16)
        bias = None if not broad or linear.bias is None else linear.bias.detach().to(torch.bfloat16).clone()
        self.register_buffer("broad_bias", bias)
        self.wide = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.narrow is not None and rows <= self.narrow_rows:
            return self.narrow(x).to(x.dtype)
        if self.broad_weight is not None and 0 < self.broad_rows <= rows:
            return nn.functional.linear(x.to(torch.bfloat16), self.broad_weight, self.broad_bias).to(x.dtype)
        return self.wide(x.float()).to(x.dtype)

    def extra_repr(self) -> str:
        broad = f", bfloat16 from {self.broad_rows} rows" if self.broad_weight is not None and self.broad_rows else ""
        return f"int4 up to {self.narrow_rows} rows{broad}, else the wide kernel"


def split_by_rows(model: nn.Module, narrow_rows: int, broad: bool = False, not_broad: Collection[nn.Module] = ()
                  ) -> int:
    """Wrap `model`'s plain float `nn.Linear`s in `RowDispatchLinear`s, in place (before quantizing `wide` to int8);
    returns how many have an int4 copy. Every layer is wrapped, so each int8 layer gets float32 activations even
    where the model computes in bfloat16 between layers. `broad`: each but those in `not_broad` (the output layer:
    a pass keeps a few rows of logits, and a vocabulary-wide copy is the largest) also keeps a bfloat16 copy of its
    weights, unused until `set_broad_rows`."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                group = int4_group_size(child)
                keep = broad and not any(child is layer for layer in not_broad)
                setattr(parent, name, RowDispatchLinear(child, group, narrow_rows, keep))
                count += group is not None
    return count


def set_broad_rows(model: nn.Module, broad_rows: int) -> None:
    """Passes of at least `broad_rows` rows take the bfloat16 copies, where kept (0: never)."""
    for module in model.modules():
        if isinstance(module, RowDispatchLinear):
            module.broad_rows = broad_rows


def set_narrow_rows(model: nn.Module, narrow_rows: int) -> None:
    """Move every `RowDispatchLinear`'s threshold (0: dynamic int8 only)."""
    for module in model.modules():
        if isinstance(module, RowDispatchLinear):
            module.narrow_rows = narrow_rows
