"""A reference row for CPUs without native bfloat16: plain `generate` on the target loaded in bfloat16.

On such a CPU (AVX2 only, e.g. AMD Zen 3) `--dtype auto` runs every strategy in float32, because a bfloat16 pass over
n tokens costs about n one-token passes there and no tree can pay. But a one-token bfloat16 pass reads half the
bytes of a float32 one, so plain decoding in bfloat16 may be the fastest thing a Transformers user can pick on that
machine (measured on a Zen 3: 234 ms per token against 376 for the prepacked float32 target). This row times it on
the measured prompts, after the other rows, in the same process, so the table says whether speculation beats it.
Its outputs are not compared: bfloat16 rounds differently from float32.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from hf_specdec.runtime.devices import native_bfloat16

from .runner import BenchSettings, plain_reference_calls
from .strategies import PLAIN

LABEL = "plain (bfloat16)"


def wanted_by_default(dtype_name: str, offload: bool, route: str) -> bool:
    """On by default where it answers a real question: a float32 run on a CPU that does not multiply bfloat16
    natively, with a target neither offloaded nor quantized (`route`: the quantization it was loaded through), whose
    bfloat16 copy would not be comparable."""
    return (dtype_name == "float32" and not torch.cuda.is_available() and not native_bfloat16(False)
            and not offload and route == "none")


def reference_strategy() -> dict[str, Any]:
    """The row's entry in results.json's strategy list."""
    return {"label": LABEL, "name": PLAIN, "kind": "reference", "settings": {"dtype": "bfloat16"}, "uses_draft": False}


def run_plain_bfloat16(source: str, prompts: dict[int, torch.LongTensor], settings: BenchSettings,
                       progress: bool = True) -> list[dict[str, Any]]:
    """Plain `generate` on `source` loaded in bfloat16: one short warm-up call, then `settings.repeats` calls per
    prompt (keyed by its index in the run, which seeds it as the other rows' calls were): records shaped like the
    bench's own calls."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    try:
        return plain_reference_calls(model, prompts, settings, LABEL, progress)
    finally:
        del model
