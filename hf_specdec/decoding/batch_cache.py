"""The cache a batch call returns, laid out as plain batched `generate` returns its own.

Plain's cache holds, in column j of row r, the key/value of the token at `sequences[r, j]`, for every column but the
last. The batch loop's cache has holes (a row that accepted fewer tokens than the longest leaves stale columns) and
loses each row when it finishes. So a row's columns are packed in sequence order as it leaves the batch
(`FinishedRows.take`, no host read), and once every row has left they are written back into the call's cache in
plain's layout (`FinishedRows.into`). Plain goes on feeding a row that stopped before the longest one: its last
token, then `pad_token_id` every step, attended to (its mask grows with ones), so its cache holds their keys too.
One more target pass over those rows computes them the same way (each row's chain of its last token and pads after
its own tokens, at plain's positions). Every column then holds what plain's does: the prompt's, left pads included,
bit for bit (the same prefill), the others to float32 rounding (computed in other matrix shapes).
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from ..accept.kv_cache import gather_row_columns
from ..accept.ragged import RaggedRows
from ..core.releases import cache_arg
from ..core.tree import TokenTree


class FinishedRows:
    """Each batch row's cache columns in sequence order, kept as the row leaves the batch."""

    def __init__(self, prompt_columns: int) -> None:
        self.prompt = prompt_columns  # the prefill's columns: pads included, the same in every row
        self.groups: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = []

    def take(self, cache: Cache, rows: RaggedRows, leaving: list[int], originals: list[int]) -> None:
        """Keep batch rows `leaving` (the call's rows `originals`) before they leave `cache`."""
        order, counts = rows.packed_order(leaving, self.prompt)
        self.groups.append((originals, gather_row_columns(cache, leaving, order, counts)))

    def into(self, cache: Cache, target: PreTrainedModel, lengths: list[int], pads: list[int],
             last_tokens: list[int], pad_token_id: int) -> Cache:
        """Write every row back into `cache` (which lost them all) in plain's layout for sequences of `lengths`
        (left pads included; the output is as wide as the longest), and give every row shorter than the longest
        what plain fed it after its packed columns: its last token (`last_tokens`, host ints: nothing is read
        back), then `pad_token_id` up to the longest row's last column."""
        width = max(lengths) - 1
        for number, layer in enumerate(cache.layers):
            parts = [(originals, layers[number]) for originals, layers in self.groups]
            layer.keys, layer.values = (_laid_out(parts, side, len(lengths), width) for side in (0, 1))
        short = [row for row, length in enumerate(lengths) if length - 1 < width]
        if short:
            tail_keys(target, cache, short, [lengths[row] - 1 for row in short], [pads[row] for row in short],
                      [[last_tokens[row]] + [pad_token_id] * (width - lengths[row]) for row in short])
        return cache


def _laid_out(parts: list[tuple[list[int], tuple[torch.Tensor, torch.Tensor]]], side: int, batch: int,
              width: int) -> torch.Tensor:
    """One layer's keys (side 0) or values (1) `(batch, heads, width, dim)` from the packed groups of rows."""
    first = parts[0][1][side]
    out = first.new_zeros(batch, first.shape[1], width, first.shape[-1])
    for originals, tensors in parts:
        columns = min(tensors[side].shape[2], width)
        out[torch.tensor(originals, dtype=torch.long).to(out.device), :, :columns] = tensors[side][:, :, :columns]
    return out


def tail_keys(target: PreTrainedModel, cache: Cache, rows: list[int], starts: list[int], pads: list[int],
              chains: list[list[int]]) -> None:
    """Put into columns `starts[i]`, `starts[i] + 1`, ... of batch row `rows[i]` of `cache` the keys/values of the
    tokens `chains[i]` there, as plain generate computes them: one target pass over those rows, each token seeing its
    row's tokens before it (columns `pads[i]` on) at the position plain gives it (how many tokens precede it)."""
    width = cache.layers[0].keys.shape[2]
    device = cache.layers[0].keys.device
    span = torch.arange(width)[None]
    valid = (span >= torch.tensor(pads)[:, None]) & (span < torch.tensor(starts)[:, None])
    trees = [TokenTree.from_parents(chain, list(range(-1, len(chain) - 1))) for chain in chains]
    inputs, positions, mask = RaggedRows(valid.to(device)).tree_inputs(trees, target.dtype)
    picked = {}
    for layer in cache.layers:
        if layer.keys.device not in picked:
            picked[layer.keys.device] = torch.tensor(rows, dtype=torch.long).to(layer.keys.device)
    subset = DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, picked[layer.keys.device]),
                                           layer.values.index_select(0, picked[layer.keys.device]))
                                          for layer in cache.layers])
    with torch.no_grad():
        target(input_ids=inputs, attention_mask=mask, position_ids=positions, **cache_arg(subset), use_cache=True)
    for layer, computed in zip(cache.layers, subset.layers):
        for index, (row, start, chain) in enumerate(zip(rows, starts, chains)):
            end = start + len(chain)
            layer.keys[row, :, start:end] = computed.keys[index, :, width : width + len(chain)]
            layer.values[row, :, start:end] = computed.values[index, :, width : width + len(chain)]
