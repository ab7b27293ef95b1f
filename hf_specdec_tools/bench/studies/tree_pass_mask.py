"""A pass through our tree pass (its 4D additive mask) against the same tokens as a plain causal pass.

    python -m hf_specdec_tools.bench.studies.tree_pass_mask --output benchmarks/results/xeon-amx/tree-pass-mask.json

The embedded pair as the bench loads it (bfloat16, the target prepacked, the draft "mixed"), after the first HumanEval
prompt but its last 9 tokens: `n` of those fed as a chain, once as `model(...)` with the cache (the causal mask plain
`generate` and Transformers' assisted generation use) and once as `decoding.step.tree_pass` over that chain (the mask
a tree needs), alternating, the cache cropped back after each; the median of `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.accept.kv_cache import crop, full_length_cache
from hf_specdec.core.releases import cache_arg
from hf_specdec.core.tree import TokenTree
from hf_specdec.decoding.step import tree_pass
from hf_specdec.runtime.attention import AttentionLayout
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models


def pass_seconds(model, cache, ids: torch.Tensor, past: int, chain: TokenTree | None) -> float:
    """One pass over the chain after `past` cached tokens (as a tree when `chain` is given, else causal); the cache
    cropped back to `past` after it."""
    layout = AttentionLayout.of(model)
    start = time.perf_counter()
    if chain is None:
        model(ids[:, past : past + ids.shape[1] - past], **cache_arg(cache), use_cache=True)
    else:
        tree_pass(model, chain, past, cache, layout, model.dtype, torch.device("cpu"))
    seconds = time.perf_counter() - start
    crop(cache, past)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    models = load_models(dtype=torch.bfloat16, int8_draft=True, prepack=True, progress=False)
    ids = tokenize_prompts(models.tokenizer, load_prompt_source("humaneval:1"))[0]
    past, rows = ids.shape[1] - 9, []
    for name, model in (("target", models.target), ("draft", models.draft)):
        for n in (int(size) for size in args.sizes.split(",")):
            cache = full_length_cache(DynamicCache())
            fed = ids[:, : past + n]
            chain = TokenTree.from_parents(ids[0, past : past + n].tolist(), [-1] + list(range(n - 1)))
            causal, masked = [], []
            with torch.no_grad():
                model(ids[:, :past], **cache_arg(cache), use_cache=True, logits_to_keep=1)
                for _ in range(args.rounds):
                    causal.append(pass_seconds(model, cache, fed, past, None))
                    masked.append(pass_seconds(model, cache, fed, past, chain))
            row = {"model": name, "past": past, "tokens": n, "causal_ms": 1000 * statistics.median(causal),
                   "tree_pass_ms": 1000 * statistics.median(masked)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": {"cpu": cpu_model(), "flags": cpu_flags(),
                                                   "torch": torch.__version__}, "passes": rows}, indent=1))


if __name__ == "__main__":
    main()
