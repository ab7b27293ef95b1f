"""The draft's output layer over the K most frequent tokens (FR-Spec): draft pass time and acceptance against K.

    .venv/bin/python -m hf_specdec_tools.bench.studies.draft_vocabulary --output benchmarks/draft-vocabulary

For each K (and the whole vocabulary), the embedded int8 draft is restricted to the K tokens most frequent in a
corpus that ships with every machine and is disjoint from the measured prompts: the Python standard library's
sources except the modules the code-continuation prompts are cut from, and HumanEval prompts 100-163. Then, in one
process: draft pass time over 1/4/16 tokens (median), the target's pass over 1 token for scale, and `specexec`
greedy on HumanEval and code-continuation prompts with each draft against plain `generate` (outputs checked
identical; one untimed call per draft first, where specexec measures that draft's latency curves): tokens per
target step, draft passes per token, and the time ratio to plain measured right before it.
Writes `results.json` (the machine, settings and every figure) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_specdec import frequent_tokens, prepack, quantize_draft
from hf_specdec.plan.latency import measure_latency
from hf_specdec_tools import models
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.prompts import code_prompts, held_out_corpus, humaneval_prompts

SIZES = (1, 4, 16)


def timed_generate(model, ids, **kwargs) -> tuple[torch.Tensor, float, object]:
    start = time.perf_counter()
    out = model.generate(ids, do_sample=False, return_dict_in_generate=True, **kwargs)
    return out.sequences, time.perf_counter() - start, getattr(out, "speculation_stats", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/draft-vocabulary"))
    parser.add_argument("--sizes", default="8192,16384,32768,65536", help="K values (the whole vocabulary is added).")
    parser.add_argument("--prompts", type=int, default=3, help="Prompts of each set (HumanEval, code).")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    target, draft, tokenizer = models.load_default_pair(dtype=dtype, progress=False)
    prepack(target)
    corpus = held_out_corpus()
    sizes = [int(k) for k in args.sizes.split(",")] + [None]
    drafts = {k: quantize_draft(draft, vocabulary=None if k is None else frequent_tokens(tokenizer, corpus, k))
              for k in sizes}
    del draft
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in
               humaneval_prompts(args.prompts) + code_prompts(args.prompts)]
    target_ms = measure_latency(target, (1,), past_length=256, repeats=3, progress=False, stop_ratio=None)
    rows = {}
    for k, model in drafts.items():
        curve = measure_latency(model, SIZES, past_length=256, repeats=5, progress=False, stop_ratio=None)
        rows[k or "all"] = {"draft_ms": {n: round(s * 1000, 2) for n, s in zip(curve.sizes, curve.seconds)},
                            "steps": [], "ratios": [], "draft_passes": []}
    for model in drafts.values():  # untimed: each draft's first call measures its latency curves for the sizing
        target.generate(prompts[0], assistant_model=model, speculation="specexec", do_sample=False, max_new_tokens=8)
    target.generate(prompts[0], do_sample=False, max_new_tokens=8)
    for ids in prompts:  # interleaved: plain right before each draft's run on the same prompt
        for k, model in drafts.items():
            plain, plain_s, _ = timed_generate(target, ids, max_new_tokens=args.max_new_tokens)
            out, seconds, stats = timed_generate(target, ids, max_new_tokens=args.max_new_tokens,
                                                 assistant_model=model, speculation="specexec")
            assert torch.equal(out, plain), f"vocabulary {k}: output differs from plain generate"
            row = rows[k or "all"]
            row["steps"].append(stats.new_tokens / stats.target_forwards)
            row["draft_passes"].append(stats.draft_forwards / stats.new_tokens)
            row["ratios"].append(plain_s / seconds)
    table = ["| draft vocabulary | draft ms 1/4/16 tokens | / target pass(1) | tokens per step | draft passes "
             "per token | speedup vs plain (median) |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        ms = row["draft_ms"]
        row.update(tokens_per_step=round(statistics.median(row["steps"]), 2),
                   speedup=round(statistics.median(row["ratios"]), 3),
                   draft_passes_per_token=round(statistics.median(row["draft_passes"]), 2),
                   draft_over_target=round(ms[1] / (target_ms.seconds[0] * 1000), 3))
        table.append(f"| {name} | {ms[1]}/{ms[4]}/{ms[16]} | {row['draft_over_target']} | {row['tokens_per_step']} | "
                     f"{row['draft_passes_per_token']} | {row['speedup']} |")
    print("\n".join(table))
    (args.output / "results.json").write_text(json.dumps({
        "environment": collect_environment(), "dtype": args.dtype, "target_ms_1": round(target_ms.seconds[0] * 1000, 2),
        "prompts": f"humaneval:{args.prompts} + code:{args.prompts}", "max_new_tokens": args.max_new_tokens,
        "method": "specexec (greedy, sized every step)", "rows": rows, "table": table}, indent=1))
    (args.output / "results.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
