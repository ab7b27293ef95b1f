"""Best-first trees with the online acceptance curve binned two ways, on the real pair, in one process.

    .venv/bin/python -m hf_specdec_tools.bench.studies.acceptance_bins --prompts code:8 \
        --output benchmarks/results/zen4/draft-cost/bins-code8.json

`OnlineAcceptance` (what `specexec` and `staged` rate a drafted token by: how often the target keeps a token the
draft gave probability q) was binned in 16 equal steps of log q from 1e-4 to 1, so one bin held every q in
[0.56, 1]; it is now binned on log(1 - q) above q = 1/2. This runs each method with the earlier layout ("log-q") and
today's ("finer top") alternately per prompt, each layout with its own learned curves and guards (as two processes
would have), greedy, on the bench's models (`--dtype auto`, prepacked target, `quantize_draft`'s default draft), and
reports per method the median over prompts of the earlier layout's seconds over today's, tokens per step, and how
many outputs equal plain `generate`'s (run first per prompt).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from hf_specdec.plan import guard, step_sizing
from hf_specdec.plan.step_sizing import OnlineAcceptance
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models


def log_q_bins(bins: int = 16, min_prob: float = 1e-4, prior_weight: float = 4.0) -> OnlineAcceptance:
    """The earlier layout: `bins` equal steps of log q from `min_prob` to 1, the prior centred on q."""
    curve = OnlineAcceptance()
    curve.edges = np.linspace(math.log(min_prob), 0.0, bins + 1, dtype=np.float32)[1:-1]
    centres = np.exp(np.linspace(math.log(min_prob), 0.0, 2 * bins + 1, dtype=np.float32)[1::2])
    curve.trials = np.full(bins, prior_weight, dtype=np.float64)
    curve.hits = centres.astype(np.float64) * prior_weight
    return curve


LAYOUTS = {"log-q": log_q_bins, "finer top": OnlineAcceptance}


class Layout:
    """One binning with its own learned curves and guards, swapped in around each call."""

    def __init__(self, make) -> None:
        self.make, self.learned, self.guards = make, weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()

    def __enter__(self) -> None:
        step_sizing.OnlineAcceptance, step_sizing._LEARNED, guard._REMEMBERED = self.make, self.learned, self.guards

    def __exit__(self, *exc) -> None:
        step_sizing.OnlineAcceptance = OnlineAcceptance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="code:8")
    parser.add_argument("--methods", default="specexec")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, resolve_dtype(args.dtype))
    models = load_models(dtype=dtype, int8_draft=True, prepack=True, progress=False)
    target, draft = models.target, models.draft
    prompts = tokenize_prompts(models.tokenizer, load_prompt_source(args.prompts))
    layouts = {name: Layout(make) for name, make in LAYOUTS.items()}
    methods = args.methods.split(",")
    for method in methods:  # a warm-up call per layout (the plan lookup, first-call allocations)
        for layout in layouts.values():
            with layout:
                target.generate(prompts[0], assistant_model=draft, speculation=method, do_sample=False,
                                max_new_tokens=8)
    calls = []
    for index, ids in enumerate(prompts):
        plain = target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
        for method in methods:
            order = list(layouts) if index % 2 == 0 else list(layouts)[::-1]  # who goes first alternates
            for name in order:
                with layouts[name]:
                    start = time.perf_counter()
                    out = target.generate(ids, assistant_model=draft, speculation=method, do_sample=False,
                                          max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
                    seconds = time.perf_counter() - start
                stats = out.speculation_stats
                calls.append({"prompt": index, "method": method, "layout": name, "seconds": seconds,
                              "new_tokens": stats.new_tokens, "tokens_per_step": stats.mean_tokens_per_step,
                              "identical": bool(torch.equal(out.sequences, plain))})
                print(f"prompt {index} {method:9s} {name:9s} {seconds:6.2f} s  {stats.mean_tokens_per_step:.2f} "
                      f"tokens/step", flush=True)
    summary = {}
    for method in methods:
        rows = {name: [c for c in calls if c["method"] == method and c["layout"] == name] for name in layouts}
        old, new = rows["log-q"], rows["finer top"]
        ratios = [o["seconds"] / n["seconds"] for o, n in zip(old, new)]
        summary[method] = {
            "old_seconds_over_new_median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            **{f"tokens_per_step {name}": sum(c["new_tokens"] for c in r) / sum(c["new_tokens"] / c["tokens_per_step"]
                                                                             for c in r) for name, r in rows.items()},
            **{f"identical {name}": f"{sum(c['identical'] for c in r)}/{len(r)}" for name, r in rows.items()},
        }
        print(method, json.dumps(summary[method]), flush=True)
    args.output.write_text(json.dumps({"environment": collect_environment(), "settings": vars(args) | {
        "output": str(args.output), "dtype": str(dtype)}, "summary": summary, "calls": calls}, indent=1))


if __name__ == "__main__":
    main()
