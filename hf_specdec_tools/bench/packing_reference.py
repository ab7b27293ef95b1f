"""A reference row for a prepacked CPU target: plain `generate` on the target packed for one-token passes.

`hf_specdec.prepack` blocks the weights for passes over 16 tokens (tree passes), and every other row, plain
`generate` included, runs on that one packing so that outputs compare token for token. Plain decoding makes
one-token passes only, and on some CPUs a packing for one row makes those cheaper (Zen 3, float32: 505-525 ms
against 627-719, benchmarks/results/zen3/kernels/prepack-hints.json). This row repacks the target that way after the
other rows, times plain decoding on the measured prompts in the same process, and packs it back as it was, so the
table says whether speculation beats the fastest plain decoding the library offers. Its outputs are not compared:
another blocking may round differently.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from hf_specdec.kernels import prepack, unpack
from hf_specdec.kernels.prepack import kernels_tag
from hf_specdec.runtime.devices import kernels

from .runner import BenchSettings, plain_reference_calls
from .strategies import PLAIN

LABEL = "plain (packed for 1 row)"


def unavailable(target: PreTrainedModel) -> str | None:
    """Why the row cannot run on `target`, or None."""
    if kernels(target) != kernels_tag():
        return "the target is not prepacked with the default packing (it needs --prepack on a CPU)"
    return None


def reference_strategy() -> dict[str, Any]:
    """The row's entry in results.json's strategy list."""
    return {"label": LABEL, "name": PLAIN, "kind": "reference", "settings": {"rows_hint": 1}, "uses_draft": False}


def run_plain_one_row(target: PreTrainedModel, prompts: dict[int, torch.LongTensor], settings: BenchSettings,
                      progress: bool = True) -> list[dict[str, Any]]:
    """Plain `generate` on `target` repacked for one-row passes; `target` is packed back as it was afterwards."""
    unpack(target)
    try:
        prepack(target, measure=False, rows_hint=1)
        return plain_reference_calls(target, prompts, settings, LABEL, progress)
    finally:
        unpack(target)
        prepack(target, measure=False)
