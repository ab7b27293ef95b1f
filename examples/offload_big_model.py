"""A target too big for memory: accelerate keeps a budget of it in RAM and reads the rest from disk.

With most of the target's layers offloaded, every target pass streams those weights from disk, so the
target pass is by far the slowest thing: the fewer target passes speculation needs, the bigger the win.
The draft stays in memory. On a CPU-only machine `device_map="auto"` places modules on "cpu" up to
`max_memory["cpu"]` and the rest on "disk" (weights read from the checkpoint or from `offload_folder`).
Run: `python examples/offload_big_model.py [MAX_CPU_MEMORY]` (default 1GiB).
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

import hf_specdec  # noqa: F401  (adds `speculation=` to generate)


def load_offloaded(path: str, offload_folder: str, max_memory: str | int, dtype: torch.dtype):
    """The target with at most `max_memory` of it in RAM; `hf_device_map` says where each module went."""
    return AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={"cpu": max_memory}, offload_folder=offload_folder, dtype=dtype
    ).eval()


def main(
    target_path: str,
    draft,
    tokenizer,
    offload_folder: str,
    max_memory: str | int = "1GiB",
    prompt: str = "def binary_search(items, target):\n",
    max_new_tokens: int = 48,
) -> dict:
    """Load the target offloaded, then compare plain and tree decoding on it."""
    target = load_offloaded(target_path, offload_folder, max_memory, draft.dtype)
    on_disk = [name for name, place in target.hf_device_map.items() if place == "disk"]
    print(f"{len(on_disk)} of {len(target.hf_device_map)} modules of the target on disk")
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    start = time.perf_counter()
    plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = target.generate(
        ids,
        assistant_model=draft,
        speculation="tree",
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )
    tree_seconds = time.perf_counter() - start

    identical = torch.equal(out.sequences, plain)
    stats = out.speculation_stats
    print(tokenizer.decode(out.sequences[0, ids.shape[1] :]))
    print(
        f"identical to plain: {identical}; {stats.target_forwards} target passes for {stats.new_tokens} tokens; "
        f"speedup {plain_seconds / tree_seconds:.2f}x"
    )
    return {
        "target": target,
        "plain": plain,
        "identical": identical,
        "stats": stats,
        "speedup": plain_seconds / tree_seconds,
    }


if __name__ == "__main__":
    from hf_specdec_tools import models

    target_path = models.fetch(models.DEFAULT_TARGET)  # the converted safetensors folder, never loaded whole
    draft = models.load_model(models.DEFAULT_DRAFT, torch.bfloat16)
    tokenizer = models.load_tokenizer(models.DEFAULT_TARGET)
    with tempfile.TemporaryDirectory() as offload:
        main(str(target_path), draft, tokenizer, offload, max_memory=sys.argv[1] if len(sys.argv) > 1 else "1GiB")
