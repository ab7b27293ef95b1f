"""Argmax and top-k over vocabulary-wide rows, fast on a CPU.

On a CPU, `torch.argmax` and `torch.topk` over a 151,936-wide row cost 0.5-1 ms each (measured on Zen 4, torch 2.13,
one thread) where `amax` over the same row costs 0.01: the first two are not vectorised over the row the way a
plain reduction is. The engine calls them on every node's row every step (greedy verification, a drafter's
children, a sampled row's top-k columns), so on small models they become most of a step's own time.

Both functions here read the row once through a vectorised block maximum (`amax` over blocks of `BLOCK` columns),
then run the slow operation on a few blocks only:
- `row_argmax`: the first block holding the row's maximum (`argmax` over the block maxima), then the first column
  inside it holding it: exactly `torch.argmax(dim=-1)`, which returns the first maximal column. NaN counts as the
  maximum in `amax` and in both `argmax`es alike, so a NaN row gives its first NaN, as torch does. The columns past
  the last whole block are read as one more block that overlaps the one before it: where that block wins, no
  earlier block holds the maximum. No host read.
- `row_topk`: the blocks whose maximum is at least the k-th largest block maximum hold at least k columns that
  large, so they hold the row's k largest values; a top-k over them gives the values `torch.topk` gives. Among
  columns with equal values either may return any of them (torch promises no order of ties).
Other devices, narrow rows and rows where the blocks would not narrow much take torch's own operation.
"""

from __future__ import annotations

import torch

BLOCK = 128  # columns per block maximum
WIDE = 16_384  # narrower rows take torch's own operation


def row_argmax(rows: torch.Tensor) -> torch.Tensor:
    """`rows.argmax(dim=-1)` for `(m, V)` rows: the first column holding each row's maximum."""
    maxima = _block_maxima(rows)
    if maxima is None:
        return rows.argmax(dim=-1)
    width = rows.shape[1]
    starts = (maxima.argmax(dim=-1) * BLOCK).clamp_(max=width - BLOCK)  # the overlapping last block starts early
    columns = starts[:, None] + torch.arange(BLOCK, device=rows.device)
    return starts + rows.gather(1, columns).argmax(dim=-1)


def row_topk(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, indices)` of `rows.topk(k, dim=-1)` for `(m, V)` rows, values in descending order."""
    if k == 1 and rows.dim() == 2 and rows.shape[1]:  # a chain's child, greedy: the argmax, without a host read
        columns = row_argmax(rows)[:, None]
        return rows.gather(1, columns), columns
    blocks = _blocks(rows) if 0 < k <= rows.shape[-1] // (4 * BLOCK) else None
    if blocks is None:
        top = rows.topk(k, dim=-1)
        return top.values, top.indices
    maxima, tail = blocks
    if bool(maxima.isnan().any()):  # topk ranks NaN first, `>=` never holds for it: leave such rows to torch
        top = rows.topk(k, dim=-1)
        return top.values, top.indices
    kth = maxima.topk(k, dim=-1).values[:, -1:]
    count = int((maxima >= kth).sum(dim=-1).amax())  # a read on the host: this path runs on a CPU only
    if count * BLOCK > rows.shape[1] // 4:  # flat rows: the blocks do not narrow them enough
        top = rows.topk(k, dim=-1)
        return top.values, top.indices
    chosen = maxima.topk(count, dim=-1).indices  # per row, at least its blocks whose maximum is >= its k-th
    columns = (chosen[..., None] * BLOCK + torch.arange(BLOCK, device=rows.device)).flatten(1)
    if tail.shape[1]:
        start = maxima.shape[1] * BLOCK
        columns = torch.cat([columns, torch.arange(start, rows.shape[1]).expand(len(rows), -1)], dim=1)
    top = rows.gather(1, columns).topk(k, dim=-1)
    return top.values, columns.gather(1, top.indices)


def _blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(maxima, tail)`: each row's block maxima `(m, V // BLOCK)` and its last `V % BLOCK` columns; None where
    torch's own operation is as fast (not a CPU, narrow rows, rows not contiguous along the vocabulary)."""
    if rows.device.type != "cpu" or rows.dim() != 2 or rows.shape[1] < WIDE or rows.stride(1) != 1:
        return None
    m, width = rows.shape
    count = width // BLOCK
    head = rows.as_strided((m, count, BLOCK), (rows.stride(0), BLOCK, 1))
    return head.amax(dim=-1), rows[:, count * BLOCK :]


def _block_maxima(rows: torch.Tensor) -> torch.Tensor | None:
    """Each row's block maxima `(m, ceil(V / BLOCK))`, the last block overlapping the one before it where `BLOCK`
    does not divide V; None where torch's own operation is as fast (see `_blocks`)."""
    blocks = _blocks(rows)
    if blocks is None:
        return None
    maxima, tail = blocks
    if not tail.shape[1]:
        return maxima
    return torch.cat([maxima, rows[:, -BLOCK:].amax(dim=-1, keepdim=True)], dim=1)
