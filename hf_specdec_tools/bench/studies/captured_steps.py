"""A step captured whole against the same shape through the loop, and plain static-cache decoding, in one process.

    python -m hf_specdec_tools.bench.studies.captured_steps --output benchmarks/results/zen4/captured-steps.json

`captured=True` (hf_specdec/decoding/captured.py) runs a step as one function of device work on static caches, read
once; on a GPU it is compiled whole (one CUDA graph per shape), which is what it is for. On a CPU it runs eagerly, so
this measures what it costs there: the embedded pair (`--dtype auto`: bfloat16 where this CPU multiplies it natively,
the target prepacked, the draft from `quantize_draft`'s default), HumanEval prompts, each shape (two fixed ones, and
`sequoia` at its defaults, captured from bucketed shapes) run through the loop and captured (both with `guard=False`:
every step speculates; with `--guard` also captured with the measured guard on), beside plain static-cache
`generate`, the rows interleaved per prompt after one warm-up call each; greedy, or sampled with `--sampled`. Writes
every call's seconds per token, tokens per step and whether its tokens equal plain's (a bfloat16 tree pass may round
a near-tie the other way), and per row the median over prompts of plain's seconds per token over the row's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, plan_tree, prepack, quantize_draft
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.models import load_default_pair
from hf_specdec_tools.prompts import humaneval_prompts

SHAPES = {
    "chain 6": ChainConfig(num_draft_tokens=6, confidence_threshold=0, per_step=False, guard=False),
    "sequoia plan 24": SequoiaConfig(plan=plan_tree([0.75, 0.1, 0.05, 0.02], budget=24, max_depth=7), guard=False),
    # at its defaults: sized every step (captured: from a few bucketed shapes, `shape_sizing.bucketed`)
    "sequoia sized": SequoiaConfig(guard=False),
    # best-first trees of a fixed budget, and at the defaults (captured: grown on the device; sized every step from
    # a few budgets)
    "specexec 16": SpecExecConfig(budget=16, guard=False),
    "specexec sized": SpecExecConfig(guard=False),
}
#: `--sampled`: what the real-pair bench samples with
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50}


def rows(draft, guarded: bool = False) -> dict[str, dict]:
    """generate's kwargs per row: plain, then each shape through the loop and captured (and captured with the
    measured guard on, its default, where `guarded`)."""
    table = {"plain static": {}}
    ways = [("loop", False, False), ("captured", True, False), *([("captured, guarded", True, True)] * guarded)]
    for name, config in SHAPES.items():
        for how, captured, guard in ways:
            table[f"{name} ({how})"] = {"assistant_model": draft,
                                        "speculation": dataclasses.replace(config, captured=captured, guard=guard)}
    return table


def call(target, ids: torch.Tensor, new_tokens: int, kwargs: dict,
         sampling: dict | None = None) -> tuple[torch.Tensor, float, object]:
    start = time.perf_counter()
    out = target.generate(ids, max_new_tokens=new_tokens, cache_implementation="static",
                          return_dict_in_generate=True, **(sampling or {"do_sample": False}), **kwargs)
    return out.sequences, time.perf_counter() - start, getattr(out, "speculation_stats", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("captured-steps.json"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--sampled", action="store_true", help=f"sample ({SAMPLING}) instead of greedy decoding")
    parser.add_argument("--guard", action="store_true",
                        help="also each shape captured with the measured guard on (its default): what judging costs")
    args = parser.parse_args()
    sampling = SAMPLING if args.sampled else None
    dtype = getattr(torch, resolve_dtype(args.dtype))
    target, draft, tokenizer = load_default_pair(dtype)
    packed = prepack(target)
    draft = quantize_draft(draft)
    table = rows(draft, args.guard)
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in humaneval_prompts(args.prompts)]
    for kwargs in table.values():
        call(target, prompts[0], 8, kwargs, sampling)
    calls = []
    for index, ids in enumerate(prompts):
        names = list(table)
        names = names[index % len(names):] + names[: index % len(names)]  # rotated from prompt to prompt
        plain = None
        for name in ["plain static", *[n for n in names if n != "plain static"]]:
            sequence, seconds, stats = call(target, ids, args.new_tokens, table[name], sampling)
            plain = sequence if name == "plain static" else plain
            new = sequence.shape[1] - ids.shape[1]
            calls.append({"prompt": index, "row": name, "seconds_per_token": seconds / new, "new_tokens": new,
                          "same_as_plain": None if sampling else bool(torch.equal(sequence, plain)),
                          "tokens_per_step": stats.mean_tokens_per_step if stats else 1.0,
                          "plain_steps": stats.plain_steps if stats else None,
                          "captured": bool(stats and stats.captured)})
            print(f"{index} {name:28} {seconds / new:.3f} s/token, {calls[-1]['tokens_per_step']:.2f} tokens/step, "
                  f"same as plain: {calls[-1]['same_as_plain']}", flush=True)
    summary = {}
    for name in table:
        ratios = [next(c for c in calls if c["prompt"] == i and c["row"] == "plain static")["seconds_per_token"]
                  / next(c for c in calls if c["prompt"] == i and c["row"] == name)["seconds_per_token"]
                  for i in range(len(prompts))]
        summary[name] = {"speedup_median": statistics.median(ratios), "speedups": ratios}
        print(f"{name:28} x{summary[name]['speedup_median']:.2f} plain static (median over prompts)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"environment": collect_environment(), "dtype": str(dtype),
                                       "prepack": packed.reason, "new_tokens": args.new_tokens,
                                       "sampling": sampling,
                                       "shapes": {name: str(config.to_dict()) for name, config in SHAPES.items()},
                                       "summary": summary, "calls": calls}, indent=1, default=str))


if __name__ == "__main__":
    main()
