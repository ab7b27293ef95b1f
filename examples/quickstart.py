"""Quick start on the embedded pair: plain greedy vs `speculation="tree"`, same output, fewer target passes.

Run: `python examples/quickstart.py` (fetches the embedded Qwen2.5-Coder pair on first use).
"""

from __future__ import annotations

import time

import torch

import hf_specdec


def main(target, draft, tokenizer, prompt: str = "def quicksort(items):\n", max_new_tokens: int = 64) -> dict:
    """Generate plainly then with a tree; print the text, whether they match, and the speedup."""
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
    print(f"identical to plain: {identical}")
    print(
        f"speedup: {plain_seconds / tree_seconds:.2f}x, tokens per target step: {stats.mean_tokens_per_step:.2f} "
        f"(hf_specdec {hf_specdec.__version__})"
    )
    return {"identical": identical, "stats": stats, "speedup": plain_seconds / tree_seconds}


if __name__ == "__main__":
    from hf_specdec_tools import models

    main(*models.load_default_pair(dtype=torch.bfloat16))
