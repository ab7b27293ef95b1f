"""Keep only the accepted path in a KV cache, so no model re-processes tokens it has already seen."""

from __future__ import annotations

import torch
from transformers import Cache


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def keep_positions(cache: Cache, start: int, kept: torch.Tensor | list[int]) -> None:
    """Compact `cache` in place: of the positions from `start` on, keep `kept` (sorted, absolute ones).

    The kept rows land at `start, start + 1, ...`.

    `DynamicCache` has no API for non-contiguous positions, so kept rows are moved into place and the
    tail is cropped. Positions before `start` are never touched.
    """
    kept = torch.as_tensor(kept, dtype=torch.long)
    end = start + len(kept)
    contiguous = bool((kept == torch.arange(start, end)).all()) if len(kept) else True
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if not contiguous:
            index = kept.to(layer.keys.device)
            layer.keys[:, :, start:end] = layer.keys[:, :, index]
            layer.values[:, :, start:end] = layer.values[:, :, index]
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]


def crop(cache: Cache, length: int) -> None:
    """Drop every position from `length` on."""
    keep_positions(cache, length, [])
