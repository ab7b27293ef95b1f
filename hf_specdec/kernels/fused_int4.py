"""Projections that read the same input (a layer's query/key/value, its gate/up) as one int4 matmul.

Why: on a CPU a draft pass over a row or two is mostly fixed costs, and each int4 weight-only call has its own (the
kernel's setup, the Python around it). Measured on a 2-core Zen 4 with the 0.5B Qwen2 draft's shapes over one
row: query, key and value as three calls 81 us, as one 51; gate and up 266 us against 249: about 2 ms of a 25 ms
pass over its 24 layers. The CPU kernel packs output rows in blocks of 64 (the last block of a layer may be any
multiple of 16), so where every layer but the last fills whole blocks, their packed weights stacked along the output
rows are the packed weight of the stacked layer: the fused call's outputs are bit for bit the separate calls'. Each
fused call checks that on one row when it is built and is not used otherwise (`tests/test_lean_pass.py`). The parts
then read their rows from the stacked buffer (views), so the weights are not held twice.
"""

from __future__ import annotations

import weakref
from itertools import accumulate

import torch
from torch import nn

from .row_dispatch import RowDispatchLinear
from .weight_only import INT4_ROW_BLOCK, Int4Linear

#: output rows per block of the CPU int4 kernel's packed layout (a layer's last block: any multiple of INT4_ROW_BLOCK)
INT4_PACK_BLOCK = 64

#: the fused call built for a group of layers, by its first layer: runners of later calls reuse it while it holds
_BUILT: weakref.WeakKeyDictionary[nn.Module, FusedInt4] = weakref.WeakKeyDictionary()
#: first layers of groups whose fused call did not match their separate calls: not tried again
_REFUSED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class FusedInt4:
    """`linears` (same input) as one int4 call for the passes their int4 copies serve; outputs side by side."""

    def __init__(self, linears: list[nn.Module], parts: list[Int4Linear]) -> None:
        self.linears, self.widths = linears, [part.out_features for part in parts]
        self.stack = Int4Linear.stacked(parts)
        for part, view in zip(parts, self.stack.packed_weight.split(self.widths)):  # each part reads its stack rows
            part.packed_weight = view

    @classmethod
    def of(cls, linears: list[nn.Module]) -> FusedInt4 | None:
        """The fused call of `linears`, or None where they cannot share one: each must be an `Int4Linear` or a
        `RowDispatchLinear` with an int4 copy (all the same kind, same input width and group size, biases on all or
        none), every output width but the last filling whole packing blocks, the last no padding rows; and the fused
        call must give the separate calls' outputs bit for bit on a probe row."""
        kinds = {type(linear) for linear in linears}
        if len(kinds) != 1 or kinds.pop() not in (Int4Linear, RowDispatchLinear):
            return None
        parts = [linear if isinstance(linear, Int4Linear) else linear.narrow for linear in linears]
        if any(part is None or part.out_features % INT4_ROW_BLOCK for part in parts):
            return None
        if any(part.out_features % INT4_PACK_BLOCK for part in parts[:-1]):
            return None
        if len({(part.in_features, part.group_size, part.bias is None) for part in parts}) != 1:
            return None
        if linears[0] in _REFUSED:
            return None
        built = _BUILT.get(linears[0])
        if built is None or not built._holds(linears, parts):
            probe = torch.randn(1, parts[0].in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
            expected = torch.cat([part(probe) for part in parts], dim=-1)
            built = cls(linears, parts)
            if not torch.equal(built(probe), expected):  # a packed layout other than the one measured: stay apart
                for part, view in zip(parts, built.stack.packed_weight.split(built.widths)):
                    part.packed_weight = view.clone()
                _REFUSED.add(linears[0])
                return None
            _BUILT[linears[0]] = built
        return built

    def _holds(self, linears: list[nn.Module], parts: list[Int4Linear]) -> bool:
        """Whether `parts` still read their rows from this stack (not replaced or moved since it was built)."""
        starts = accumulate(self.widths, initial=0)
        packed = self.stack.packed_weight
        base, step = packed.data_ptr(), packed.stride(0) * packed.element_size()
        return linears == self.linears and all(
            part.packed_weight.data_ptr() == base + start * step for part, start in zip(parts, starts))

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the separate layers would run `x` on their int4 copies (a row dispatch's threshold is read live)."""
        first = self.linears[0]
        return not isinstance(first, RowDispatchLinear) or x.numel() <= first.narrow_rows * first.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side along the last dimension, in their order."""
        return self.stack(x).to(x.dtype)
