"""Keep only the accepted path in a KV cache, so no model re-processes tokens it has already seen."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def dropped_rows(cache: Cache | None) -> bool:
    """True when a sliding-window layer of `cache` has already thrown its oldest rows away (past its window)."""
    return any(
        getattr(layer, "is_sliding", False) and layer.is_initialized
        and layer.cumulative_length > layer.keys.shape[-2]
        for layer in (cache.layers if cache is not None else [])
    )


def full_length_cache(cache: DynamicCache | None) -> DynamicCache:
    """`cache` (or a new one) with every layer a plain `DynamicLayer` that keeps all its rows.

    generate builds sliding-window layers for windowed models; they keep only the last window - 1 rows, so no path
    can be compacted into them. Each is swapped, in place, for a full layer holding the same rows (so a cache the
    user passed stays the object generate updates); it must not have dropped any yet (see `dropped_rows`). The
    window itself is applied by the masks (`core.attention`).
    """
    if cache is None:
        return DynamicCache()
    if dropped_rows(cache):
        raise ValueError("This cache's sliding-window layers dropped rows already: it cannot become a full one.")
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            full = DynamicLayer()
            if layer.is_initialized:
                full.update(layer.keys, layer.values)
            cache.layers[i] = full
    return cache


def keep_positions(cache: Cache, start: int, kept: torch.Tensor | list[int]) -> None:
    """Compact `cache` in place: of the positions from `start` on, keep `kept` (sorted, absolute ones).

    The kept rows land at `start, start + 1, ...`.

    `DynamicCache` has no API for non-contiguous positions, so kept rows are moved into place and the
    tail is cropped. Positions before `start` are never touched. Every layer must keep all its rows
    (`full_length_cache`): a sliding-window layer's row i is not position i.
    """
    kept = kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)
    end = start + len(kept)
    contiguous = kept == list(range(start, end))  # decided on the host: no device read
    index: dict[torch.device, torch.Tensor] = {}  # one compaction index per device, shared by every layer there
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise TypeError("keep_positions needs full-length cache layers: build the cache with full_length_cache().")
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if not contiguous:
            device = layer.keys.device
            if device not in index:
                index[device] = torch.tensor(kept, dtype=torch.long).to(device, non_blocking=True)
            layer.keys[:, :, start:end] = layer.keys[:, :, index[device]]
            layer.values[:, :, start:end] = layer.values[:, :, index[device]]
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]


def crop(cache: Cache, length: int) -> None:
    """Drop every position from `length` on."""
    keep_positions(cache, length, [])
