"""Faster kernels for the passes speculation makes, each a model prepared once: a target's or draft's Linear weights
prepacked for oneDNN (`prepack.py`, used by plain and speculative `generate` alike, so speedups reported against
plain `generate` on the same model are speculation's own); the low-bit draft (`quantize.py` over `weight_only.py`'s
int4 and PyTorch's dynamic int8, picked per pass by its rows in `row_dispatch.py`, int4 projections fused in
`fused_int4.py`), its output layer over a subset of the vocabulary (`vocabulary.py`), and the lean pass a
Llama-shaped model's tree passes run through (`lean_pass.py`)."""

from .prepack import PackedLinear, PrepackReport, is_prepacked, prepack, unpack
from .quantize import quantize_draft
from .vocabulary import frequent_tokens, restrict_vocabulary

__all__ = ["PackedLinear", "PrepackReport", "frequent_tokens", "is_prepacked", "prepack", "quantize_draft",
           "restrict_vocabulary", "unpack"]
