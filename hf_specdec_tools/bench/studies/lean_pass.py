"""The draft's pass through the model's forward against `kernels/lean_pass.py`, per rows fed, on the embedded pair.

    .venv/bin/python -m hf_specdec_tools.bench.studies.lean_pass --output benchmarks/results/zen4/lean-pass
    python -m hf_specdec_tools.bench.studies.lean_pass --vocabulary 16384 32768 \
        --output benchmarks/results/zen4/lean-pass-fused
    python -m hf_specdec_tools.bench.studies.lean_pass --target-rows 1 8 32 \
        --output benchmarks/results/zen4/lean-pass-target

The draft is what `quantize_draft` returns here (its default scheme for this CPU), the target the embedded 1.5B in
bfloat16, prepacked. After 256 cached tokens, each round times, one after another, a draft pass over 1, 2, 4 and 8
rows both ways and the target's one-row pass, all with a 4-D additive mask and explicit positions as the engine
calls them (the cache cut back after each pass); the figure is the median over rounds. The lean pass also runs
without its fused int4 calls (`kernels/fused_int4.py`: each projection its own call), and, with `--vocabulary K`, on a
draft whose output layer covers the K tokens most frequent in `held_out_corpus()` (`frequent_tokens`), and, with
`--target-rows N`, the target's tree pass over N rows (all rows' logits) through its forward and the lean pass
(which the loop takes for the target off the CPU only: `decoding.step.lean_target`). Writes
results.json (machine, settings, every figure) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
from transformers import DynamicCache

from hf_specdec import frequent_tokens, prepack, quantize_draft
from hf_specdec.accept.kv_cache import crop
from hf_specdec.core.releases import cache_arg
from hf_specdec.kernels import lean_pass
from hf_specdec.kernels.lean_pass import LeanPass
from hf_specdec.runtime.attention import AttentionLayout
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools import models
from hf_specdec_tools.prompts import held_out_corpus

PAST = 256
ROWS = (1, 2, 4, 8)


def timed(call, cache) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        call()
    seconds = time.perf_counter() - start
    crop(cache, PAST)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--vocabulary", type=int, nargs="*", default=[], metavar="K",
                        help="Also time the lean pass of drafts with their output layer over K tokens.")
    parser.add_argument("--target-rows", type=int, nargs="*", default=[], metavar="N",
                        help="Also time the target's tree pass over N rows through its forward and the lean pass.")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    target, base, tokenizer = models.load_default_pair(dtype=torch.bfloat16, progress=False)
    prepack(target)
    draft = quantize_draft(base)
    layers = AttentionLayout.of(draft).layer_types
    lean = LeanPass.of(draft, layers)
    with mock.patch.object(lean_pass.FusedInt4, "of", lambda linears: None):
        unfused = LeanPass.of(draft, layers)
    subsets = {k: quantize_draft(base, vocabulary=frequent_tokens(tokenizer, held_out_corpus(), k))
               for k in args.vocabulary}
    ids = torch.randint(3, 5000, (1, PAST + max(ROWS + tuple(args.target_rows))),
                        generator=torch.Generator().manual_seed(0))
    caches = {"draft": DynamicCache(), "target": DynamicCache(), **{k: DynamicCache() for k in subsets}}
    with torch.no_grad():
        draft(input_ids=ids[:, :PAST], **cache_arg(caches["draft"]), use_cache=True)
        target(input_ids=ids[:, :PAST], **cache_arg(caches["target"]), use_cache=True)
        for k, subset in subsets.items():
            subset(input_ids=ids[:, :PAST], **cache_arg(caches[k]), use_cache=True)
    subset_passes = {k: LeanPass.of(subset, layers) for k, subset in subsets.items()}

    def inputs(n: int) -> dict:
        return {"input_ids": ids[:, PAST : PAST + n], "position_ids": torch.arange(PAST, PAST + n)[None],
                "attention_mask": torch.zeros(1, 1, n, PAST + n, dtype=torch.bfloat16)}

    calls = {}
    for n in ROWS:
        calls[f"draft, model forward, {n} rows"] = (lambda n=n: draft(**inputs(n), **cache_arg(caches["draft"]),
                                                                      use_cache=True, logits_to_keep=n), "draft")
        calls[f"draft, lean pass, {n} rows"] = (lambda n=n: lean(*inputs(n).values(), caches["draft"], n), "draft")
        calls[f"draft, lean pass unfused, {n} rows"] = (
            lambda n=n: unfused(*inputs(n).values(), caches["draft"], n), "draft")
        for k, run in subset_passes.items():
            calls[f"draft over {k} tokens, lean pass, {n} rows"] = (
                lambda n=n, k=k, run=run: run(*inputs(n).values(), caches[k], n), k)
    calls["target, 1 row"] = (lambda: target(**inputs(1), **cache_arg(caches["target"]), use_cache=True,
                                             logits_to_keep=1), "target")
    target_lean = LeanPass.of(target, AttentionLayout.of(target).layer_types)
    for n in args.target_rows:  # tree passes: every row's logits, through the forward and the lean pass
        calls[f"target, model forward, {n} rows"] = (
            lambda n=n: target(**inputs(n), **cache_arg(caches["target"]), use_cache=True), "target")
        calls[f"target, lean pass, {n} rows"] = (
            lambda n=n: target_lean(*inputs(n).values(), caches["target"], 0), "target")
    for call, cache in calls.values():  # warm-up
        timed(call, caches[cache])
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, (call, cache) in calls.items():
            times[name].append(1e3 * timed(call, caches[cache]))
    ms = {name: round(statistics.median(values), 2) for name, values in times.items()}
    target_ms = ms["target, 1 row"]
    for name, value in ms.items():
        print(f"{name:48s} {value:7.2f} ms   {value / target_ms:.3f} of the target's one-row pass")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps({
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "settings": {"past": PAST, "rounds": args.rounds, "draft": "quantize_draft(draft) (its default scheme here)",
                     "vocabulary": args.vocabulary,
                     "target": "bfloat16, prepacked"},
        "median_ms": ms, "all_ms": times}, indent=1))


if __name__ == "__main__":
    main()
