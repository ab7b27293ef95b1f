"""Keep only the accepted path in a KV cache, so no model re-processes tokens it has already seen.

Two kinds of cache: a `DynamicCache`, whose layers grow by concatenation (compaction moves rows, then slices the
tail off), and Transformers' `StaticCache`, whose `StaticLayer`s preallocate `max_cache_len` rows and write at a
device-side length (`cumulative_length`) with `index_copy_`: compaction copies the kept rows into place (at most
depth + 1 of them) and resets that length in place, so the buffers keep their addresses (what a compiled forward
and CUDA graphs rely on). Rows past the length are stale; the fixed-width tree masks hide them.

A model with recurrent state (Mamba, linear attention, short convolutions) keeps no row per token in those layers:
its cache records the states of the last passes once `record_states` is on (Transformers 5.25), and rolls back to a
prefix of them with Transformers' own `Cache.crop` (a chain's accepted tokens are always a prefix).
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, StaticLayer


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def keeps_state(cache: Cache | None) -> bool:
    """Whether `cache` has layers of recurrent state, which roll back only to a prefix of the positions they saw."""
    return cache is not None and any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def record_states(cache: Cache, tokens: int) -> None:
    """Let a cache of recurrent state roll back by up to `tokens` positions of the passes that follow: each pass of
    at most `tokens` tokens keeps the state after every one of them (Transformers' `activate_past_recording`)."""
    cache.activate_past_recording(recurrent_states_to_keep=tokens)


def layer_rows(layer) -> int:
    """The rows a cache layer holds: its write length for a static layer (its buffers are always full size)."""
    if isinstance(layer, StaticLayer):
        return int(layer.get_seq_length()) if layer.is_initialized else 0
    return layer.keys.shape[-2] if getattr(layer, "keys", None) is not None else 0


def dropped_rows(cache: Cache | None) -> bool:
    """True when a sliding-window layer of `cache` has already thrown its oldest rows away (past its window)."""
    return any(
        getattr(layer, "is_sliding", False) and layer.is_initialized
        and int(layer.get_seq_length()) > layer.keys.shape[-2]
        for layer in (cache.layers if cache is not None else [])
    )


def is_static(cache: Cache | None) -> bool:
    """Whether `cache` preallocates its rows (Transformers' `StaticCache` or any cache of `StaticLayer`s)."""
    return cache is not None and bool(cache.layers) and all(isinstance(layer, StaticLayer) for layer in cache.layers)


def static_capacity(cache: Cache) -> int | None:
    """How many rows every layer of a static `cache` holds once made full length (None: not a static cache, or only
    sliding-window layers, whose original `max_cache_len` the cache no longer knows)."""
    if not is_static(cache):
        return None
    full = [layer.max_cache_len for layer in cache.layers if not getattr(layer, "is_sliding", False)]
    return max(full) if full else None


def make_room(cache: Cache, rows: int) -> None:
    """Let every full-length static layer of `cache` not allocated yet hold at least `rows` rows (layers allocate
    `max_cache_len` rows on their first write)."""
    for layer in cache.layers:
        if isinstance(layer, StaticLayer) and not layer.is_sliding and not layer.is_initialized:
            layer.max_cache_len = max(layer.max_cache_len, rows)


def full_length_cache(cache: Cache | None, capacity: int | None = None) -> Cache:
    """`cache` (or a new `DynamicCache`) with every layer one that keeps all its rows.

    generate builds sliding-window layers for windowed models; they keep only the last window - 1 rows, so no path
    can be compacted into them. Each is swapped, in place, for a full layer holding the same rows (so a cache the
    user passed stays the object generate updates); it must not have dropped any yet (see `dropped_rows`). The
    window itself is applied by the masks (`core.attention`). In a static cache the new layers are `StaticLayer`s of
    the full layers' `max_cache_len` (or `capacity` when every layer is sliding), so every layer has one width.
    """
    if cache is None:
        return DynamicCache()
    if keeps_state(cache) and any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("A cache of recurrent state with sliding-window layers cannot become a full one.")
    if dropped_rows(cache):
        raise ValueError("This cache's sliding-window layers dropped rows already: it cannot become a full one.")
    static = is_static(cache)
    rows = static_capacity(cache) or capacity
    if static and rows is None:
        raise ValueError("A static cache with only sliding-window layers needs the capacity of its full-length form.")
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            cache.layers[i] = static_copy(layer, rows) if static else _full_dynamic(layer)
    return cache


def _full_dynamic(layer) -> DynamicLayer:
    full = DynamicLayer()
    if layer.is_initialized:
        full.update(layer.keys, layer.values)
    return full


def static_copy(layer: StaticLayer, rows: int) -> StaticLayer:
    """A full-length `StaticLayer` of `rows` rows holding `layer`'s (a sliding one that has not wrapped around yet, or
    a full one growing)."""
    full = StaticLayer(max_cache_len=rows)
    if layer.is_initialized:
        length = int(layer.get_seq_length())
        full.lazy_initialization(layer.keys, layer.values)
        full.keys[:, :, :length] = layer.keys[:, :, :length]
        full.values[:, :, :length] = layer.values[:, :, :length]
        full.cumulative_length.fill_(length)
    return full


def keep_positions(cache: Cache, start: int, kept: torch.Tensor | list[int]) -> None:
    """Compact `cache` in place: of the positions from `start` on, keep `kept` (sorted, absolute ones).

    The kept rows land at `start, start + 1, ...`.

    `DynamicCache` has no API for non-contiguous positions, so kept rows are moved into place and the
    tail is cropped. Positions before `start` are never touched. Every layer must keep all its rows
    (`full_length_cache`): a sliding-window layer's row i is not position i.
    """
    kept = kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)
    end = start + len(kept)
    if keeps_state(cache):
        _roll_back(cache, start, kept)
        return
    # Decided on the host, no device read: rows already in place stay; the rest either is one run of consecutive
    # rows not overlapping its destination (one slice copy per tensor) or takes an index (a gather and a copy).
    placed = next((i for i, position in enumerate(kept) if position != start + i), len(kept))
    moved = kept[placed:]
    run = bool(moved) and moved == list(range(moved[0], moved[0] + len(moved))) and moved[0] >= end
    index: dict[torch.device, torch.Tensor] = {}  # one compaction index per device, shared by every layer there
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise TypeError("keep_positions needs full-length cache layers: build the cache with full_length_cache().")
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if run:
            layer.keys[:, :, start + placed : end] = layer.keys[:, :, moved[0] : moved[-1] + 1]
            layer.values[:, :, start + placed : end] = layer.values[:, :, moved[0] : moved[-1] + 1]
        elif moved:
            device = layer.keys.device
            if device not in index:
                index[device] = torch.tensor(moved, dtype=torch.long).to(device, non_blocking=True)
            layer.keys[:, :, start + placed : end] = layer.keys[:, :, index[device]]
            layer.values[:, :, start + placed : end] = layer.values[:, :, index[device]]
        if isinstance(layer, StaticLayer):  # the buffers stay where they are: only the write length moves
            layer.cumulative_length.fill_(end)
            continue
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]


def keep_rows(cache: Cache, source: torch.Tensor, destination: torch.Tensor) -> None:
    """`keep_positions` decided on the device, for static layers: rows `source` are copied to rows `destination` (index
    tensors of one fixed length, read before written: the two may overlap) in every layer, with no host read; the
    write length is set apart (`set_length`). What a step captured whole compacts with (`decoding.captured`)."""
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            tensor.index_copy_(2, destination, tensor.index_select(2, source))


def set_length(cache: Cache, length: torch.Tensor) -> None:
    """Every static layer's write length becomes `length` (a device scalar), in place: rows past it are stale."""
    for layer in cache.layers:
        layer.cumulative_length.copy_(length)


def _roll_back(cache: Cache, start: int, kept: list[int]) -> None:
    """`keep_positions` on a cache of recurrent state: only a prefix can be kept, by Transformers' own rollback
    (`Cache.crop`, which also drops the states recorded so far: it runs after every pass, all kept or not)."""
    end, length = start + len(kept), cache_length(cache)
    if kept != list(range(start, end)):
        raise ValueError(f"A recurrent state rolls back to a prefix of its positions only, not to {kept}.")
    if length:  # nothing seen yet: nothing recorded, nothing to drop
        cache.crop(end - length)


def crop(cache: Cache, length: int) -> None:
    """Drop every position from `length` on."""
    keep_positions(cache, length, [])


def keep_positions_per_row(cache: Cache, start: int, kept: list[list[int]]) -> int:
    """`keep_positions` for a batch whose rows keep different numbers of positions (ragged acceptance).

    Row r's kept positions `kept[r]` (sorted, absolute, from `start` on) land at `start, start + 1, ...`; the
    cache is then cut to `start + max(len(k) for k in kept)`: the columns a shorter row leaves behind hold stale
    keys, and its caller marks them as holes (`accept.ragged.RaggedRows`). Returns that new length. Dynamic layers
    only (a batch never runs on a static cache).
    """
    width = max(len(row) for row in kept)
    index: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        if isinstance(layer, StaticLayer) or getattr(layer, "is_sliding", False):
            raise TypeError("keep_positions_per_row needs full-length dynamic layers.")
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        device = layer.keys.device
        if device not in index:  # a shorter row repeats its last kept column (or `start`): a hole either way
            rows = [row + [row[-1] if row else start] * (width - len(row)) for row in kept]
            index[device] = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
        gather = index[device][:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        keys, values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        layer.keys = torch.cat([layer.keys[:, :, :start], keys], dim=2)
        layer.values = torch.cat([layer.values[:, :, :start], values], dim=2)
    return start + width


def select_batch_rows(cache: Cache, rows: list[int]) -> None:
    """Keep only the batch rows `rows` of every layer (sequences that finished leave the batch)."""
    index: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        device = layer.keys.device
        if device not in index:
            index[device] = torch.tensor(rows, dtype=torch.long).to(device)
        layer.keys = layer.keys.index_select(0, index[device])
        layer.values = layer.values.index_select(0, index[device])


def gather_row_columns(
    cache: Cache, rows: list[int], order: torch.Tensor, counts: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of batch rows `rows` of every layer, row i's columns taken in `order[i]` `(R, L)` and zeroed from
    column `counts[i]` on: each row's own columns packed to the front (`accept.ragged.RaggedRows.packed_order`), so
    they outlive the row's removal from the batch. Every layer must hold keys (a batch's cache after its prefill)."""
    index: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    out = []
    for layer in cache.layers:
        device = layer.keys.device
        if device not in index:
            columns = order.to(device)
            live = torch.arange(columns.shape[1], device=device)[None] < counts.to(device)[:, None]
            index[device] = torch.tensor(rows, dtype=torch.long).to(device), columns, live[:, None, :, None]
        picked, columns, live = index[device]
        taken = []
        for tensor in (layer.keys, layer.values):
            gather = columns[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1])
            taken.append(torch.where(live, tensor.index_select(0, picked).gather(2, gather), 0))
        out.append((taken[0], taken[1]))
    return out
