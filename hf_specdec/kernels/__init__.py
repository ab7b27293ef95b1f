"""Faster kernels for the passes speculation makes: a model prepared once, used by plain and speculative
`generate` alike (so speedups reported against plain `generate` on the same model are speculation's own)."""

from .prepack import PackedLinear, PrepackReport, is_prepacked, prepack, unpack

__all__ = ["PackedLinear", "PrepackReport", "is_prepacked", "prepack", "unpack"]
