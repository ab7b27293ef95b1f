"""One long prompt, whole calls: where a speculative call's time goes against plain `generate`'s, and the price.

    python -m hf_specdec_tools.bench.studies.long_context_calls --output benchmarks/results/xeon-amx/long-context.json

The general-chat set's retrieved-context question (`--prompts chat`, the seventh chat: 760 tokens with the chat
template) through plain `generate` and each method, interleaved, `--rounds` times, the embedded pair as the bench
loads it (bfloat16, the target prepacked, the draft "mixed"). Between rounds, and before the first, the target's bare
pass over the prompt is timed, which shows how much the machine's own speed moves. Each call's prompt pass, drafting
and target-pass seconds, steps, plain steps and its price (`speculation_stats.call_price`) are recorded: the price
of a call is made from earlier calls' rates, so the first round's calls are not priced. `--windows 0 256` runs each
method once per `draft_window` (0: the draft reads the whole prompt), to see what reading less of a retrieved
context saves and costs in tokens per step; `same_as_plain` says whether a call's tokens are plain's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models


def bare_pass_seconds(target, ids: torch.Tensor) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        target(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=6, help="Which chat of `--prompts chat` (default: the RAG one).")
    parser.add_argument("--methods", default="sequoia,chain,specexec")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--windows", type=int, nargs="+", default=[None],
                        help="draft_window values each method runs with (0: the whole prompt; default: the method's).")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    models = load_models(dtype=torch.bfloat16, int8_draft=True, prepack=True, progress=False)
    ids = tokenize_prompts(models.tokenizer, load_prompt_source("chat"))[args.prompt]
    rows, bare = [], [[bare_pass_seconds(models.target, ids) for _ in range(3)]]
    runs = [(method, window) for method in args.methods.split(",") for window in args.windows] + [("plain", None)]
    plain_tokens = None
    for round_ in range(args.rounds):
        for method, window in runs:
            kwargs = {} if method == "plain" else {"assistant_model": models.draft, "speculation": method}
            if window is not None and method != "plain":
                kwargs["speculation_config"] = {"draft_window": window}
            start = time.perf_counter()
            out = models.target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                         return_dict_in_generate=True, **kwargs)
            row = {"round": round_, "method": method, "draft_window": window, "seconds": time.perf_counter() - start}
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            if method == "plain":
                plain_tokens = tokens
            row["tokens"] = tokens
            stats = getattr(out, "speculation_stats", None)
            if stats is not None:
                row.update(prefill=stats.time_prefill, drafting=stats.time_drafting,
                           target=stats.time_target_forward, steps=stats.target_forwards,
                           plain_steps=stats.plain_steps, tokens_per_step=stats.mean_tokens_per_step,
                           price=stats.call_price)
            rows.append(row)
            print(json.dumps(row), flush=True)
        bare.append([bare_pass_seconds(models.target, ids) for _ in range(2)])
    for row in rows:  # greedy: identical to plain unless a bfloat16 near-tie rounds the other way
        row["same_as_plain"] = row.pop("tokens") == plain_tokens
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__},
        "prompt_tokens": ids.shape[1], "new_tokens": args.max_new_tokens, "bare_target_pass_seconds": bare,
        "calls": rows}, indent=1))


if __name__ == "__main__":
    main()
