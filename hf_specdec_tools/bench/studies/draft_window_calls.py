"""Whole calls with the draft given only the prompt's last W tokens, against the whole prompt, in one process.

    python -m hf_specdec_tools.bench.studies.draft_window_calls --output benchmarks/results/zen5/draft-window/calls.json
    python -m hf_specdec_tools.bench.studies.draft_window_calls --context-lines 300 --prompts 6 --windows 256 1024 \
        --output benchmarks/results/zen5/draft-window/long-calls.json

`draft_window.py` measured what a window costs in agreement, teacher-forced; this measures what it saves on the
wall clock, through the methods' `draft_window` setting (`speculation_config={"draft_window": W}`; 0: the whole
prompt): from a call's first pass on, the draft never reads the prompt's first `len(prompt) - W` tokens (its positions
then start at 0: the Qwen2 draft's rotary embedding attends by relative position). The output stays the target's
(only the draft changes); in bfloat16 it may still differ from the whole-prompt call where a near-tie
rounds the other way (`same` in the JSON). Per prompt (`code_prompts`, cut from this Python's standard library) and
method, one greedy call per window, the order rotated from prompt to prompt, after one warm-up call each; the
guard's memory is cleared before every call so that no call inherits another's verdict. Writes every call's
seconds, tokens per step and draft seconds, and per method and window the median over prompts of whole / window.
With `--context-lines N` the prompts are long ones (`code_prompts(..., full_context=True)`): N lines of the same
modules before a function cut deeper in the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

from hf_specdec import prepack, quantize_draft
from hf_specdec.plan import guard
from hf_specdec_tools import models
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.prompts import code_prompts

WHOLE = 0  # the draft_window value that means the whole prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 256], help="draft_window values (and 0).")
    parser.add_argument("--methods", nargs="+", default=["tree", "specexec"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context-lines", type=int, default=None,
                        help="Long prompts: this many lines before a deeper cut (default: `code_prompts`' own).")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dtype = getattr(torch, resolve_dtype(args.dtype))
    target, draft, tokenizer = models.load_default_pair(dtype, progress=False)
    prepack(target)
    draft = quantize_draft(draft)
    texts = (code_prompts(args.prompts) if args.context_lines is None
             else code_prompts(args.prompts, args.context_lines, full_context=True))
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in texts]
    windows = [WHOLE, *args.windows]

    def call(ids: torch.Tensor, method: str, window: int) -> dict:
        guard._REMEMBERED.clear()
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, speculation=method,
                              speculation_config={"draft_window": window}, do_sample=False,
                              max_new_tokens=args.new_tokens, return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        stats = out.speculation_stats
        return {"seconds": seconds, "tokens": out.sequences[0, ids.shape[1] :].tolist(),
                "tokens_per_step": stats.mean_tokens_per_step, "draft_seconds": stats.time_draft_forward}

    for method in args.methods:  # warm-up
        for window in windows:
            call(prompts[0], method, window)
    calls = []
    for index, ids in enumerate(prompts):
        for method in args.methods:
            order = windows[index % len(windows) :] + windows[: index % len(windows)]
            runs = {window: call(ids, method, window) for window in order}
            for window, run in runs.items():
                calls.append({"prompt": index, "prompt_tokens": ids.shape[1], "method": method, "window": window,
                              "same": run["tokens"] == runs[WHOLE]["tokens"],
                              **{k: v for k, v in run.items() if k != "tokens"}})
                print(json.dumps(calls[-1]), flush=True)
    summary = {}
    for method in args.methods:
        whole = {c["prompt"]: c for c in calls if c["method"] == method and c["window"] == WHOLE}
        for window in args.windows:
            mine = [c for c in calls if c["method"] == method and c["window"] == window]
            ratios = [whole[c["prompt"]]["seconds"] / c["seconds"] for c in mine]
            longer = [round(r, 3) for r, c in zip(ratios, mine) if c["prompt_tokens"] > window]
            summary[f"{method} W={window}"] = {
                "median_whole_over_window": round(statistics.median(ratios), 3),
                "prompts_longer_than_window": longer,
                "tokens_per_step_whole_window": [round(statistics.mean(whole[c["prompt"]]["tokens_per_step"]
                                                                       for c in mine), 2),
                                                 round(statistics.mean(c["tokens_per_step"] for c in mine), 2)],
                "draft_seconds_whole_window": [round(sum(whole[c["prompt"]]["draft_seconds"] for c in mine), 2),
                                               round(sum(c["draft_seconds"] for c in mine), 2)],
            }
            print(method, window, summary[f"{method} W={window}"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "environment": collect_environment(), "dtype": str(dtype),
        "settings": {"prompts": f"code:{args.prompts}",
                     "context_lines": args.context_lines, "new_tokens": args.new_tokens, "methods": args.methods,
                     "windows": args.windows, "target": "prepacked", "draft": "quantize_draft (its default here)",
                     "greedy": True},
        "summary": summary, "calls": calls}, indent=1))


if __name__ == "__main__":
    main()
