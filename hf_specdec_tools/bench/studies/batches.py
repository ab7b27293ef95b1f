"""Speculation on a batch (issue 25) against plain batched `generate`: the embedded pair, B different HumanEval
prompts left-padded into one batch, greedy, for each batch size B; plain and speculative calls interleaved, medians.

    .venv/bin/python -m hf_specdec_tools.bench.studies.batches --batches 1,2,4,8 --new-tokens 64 --repeats 3 \\
        --output benchmarks/results/zen4/batches
    (add --prepack --int8-draft for the setup of README's Zen 4 side-by-side; --method chain --method sequoia
    times several methods side by side, each against the same plain calls; --config '{...}')

Reports per batch size: tokens/s of each (new tokens up to each row's eos, summed over rows), the ratio; the same
after the prompt's pass (a plain call for one new token, timed interleaved with the others, is taken off both calls'
seconds and its token per row off their tokens: what decoding costs once the prompts are in the target's cache, the
draft's own prompt pass still counted against speculation), tokens per target step per row (mean over rows of new
tokens / target passes) and whether the outputs are identical row by row (bfloat16 rounds batched passes
differently, so a greedy divergence there is rounding, not loss: the float32 identity is tested in
tests/test_batches.py). Writes results.json (settings, machine, every run) and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.integration.batch import speculative_rate
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.models import load_default_pair
from hf_specdec_tools.prompts import humaneval_prompts

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def new_tokens(sequences: torch.Tensor, prompt_length: int, eos: set[int]) -> list[int]:
    """Per row, the new tokens up to and including its first eos (what the row really generated)."""
    counts = []
    for row in sequences[:, prompt_length:].tolist():
        stop = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        counts.append(stop)
    return counts


def run_once(target, draft, batch, args, method: str | None) -> dict:
    """One call for `args.new_tokens` new tokens per row: plain batched `generate` (`method` None) or speculation."""
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    if method is not None:
        kwargs.update(assistant_model=draft, speculation=method, speculation_config=json.loads(args.config),
                      return_dict_in_generate=True)
    start = time.perf_counter()
    out = target.generate(**batch, **kwargs)
    seconds = time.perf_counter() - start
    sequences = out if method is None else out.sequences
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tokens = new_tokens(sequences, batch["input_ids"].shape[1], eos)
    result = {"seconds": seconds, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / seconds,
              "sequences": sequences.tolist()}
    if method is not None:
        stats = out.speculation_stats
        stats = stats if isinstance(stats, list) else [stats]  # a batch of one has one entry, not a list
        result["tokens_per_target_step_per_row"] = statistics.mean(
            row.new_tokens / max(row.target_forwards, 1) for row in stats)
        result["target_forwards"] = [row.target_forwards for row in stats]
        result["draft_forwards"] = [row.draft_forwards for row in stats]
        result["plain_steps"] = [row.plain_steps for row in stats]  # the sizing or the guard ran them plain
        result["row_rates"] = [speculative_rate(row) for row in stats]  # tokens per speculative step, per row
        result["shrunk_steps"] = [row.shrunk_steps for row in stats]  # the sizing cut the shape for the batch
        result["plan_source"] = stats[0].plan_source
    return result


def rates(runs: list[dict], rows: int, prompt_seconds: float) -> tuple[float, float]:
    """Median tokens/s of `runs` (calls over `rows` rows), whole and after the prompt's pass (`prompt_seconds` and
    the one token per row that pass gives taken off)."""
    return (statistics.median(run["tokens_per_s"] for run in runs),
            statistics.median((run["tokens"] - rows) / (run["seconds"] - prompt_seconds) for run in runs))


def steps_cell(run: dict) -> str:
    """Each row's plain / shrunk / all target steps, e.g. `0/5/12, 1/5/13`."""
    return ", ".join(f"{plain}/{shrunk}/{steps}" for plain, shrunk, steps in
                     zip(run.get("plain_steps", []), run.get("shrunk_steps", []), run["target_forwards"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved rounds per batch size (a prompt-pass call, a plain call, one per method)")
    parser.add_argument("--method", action="append",
                        help="a speculation method; repeat it to time several side by side (default: chain)")
    parser.add_argument("--config", default="{}", help="speculation_config as JSON for every --method, e.g. "
                        "'{\"num_draft_tokens\": 4}'")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prepack", action="store_true", help="hf_specdec.prepack the target (both sides use it)")
    parser.add_argument("--int8-draft", action="store_true", help="draft with hf_specdec.quantize_draft's int8 copy")
    parser.add_argument("--first-prompt", type=int, default=0,
                        help="HumanEval prompts FIRST..FIRST+B-1 make a batch of B (another set than 0..B-1)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/batches"))
    args = parser.parse_args()

    target, draft, tokenizer = load_default_pair(dtype=getattr(torch, args.dtype))
    if args.prepack:
        print(f"prepack: {hf_specdec.prepack(target).reason}")
    if args.int8_draft:
        draft = hf_specdec.quantize_draft(draft)
    tokenizer.padding_side = "left"
    methods = args.method or ["chain"]
    prompt_set = f"HumanEval {args.first_prompt}..{args.first_prompt}+B-1"
    rows = []
    for size in [int(b) for b in args.batches.split(",")]:
        prompts = humaneval_prompts(size, start=args.first_prompt)
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        runs = {"plain": [], "prompt": [], **{method: [] for method in methods}}
        warm = argparse.Namespace(**{**vars(args), "new_tokens": 4})
        for method in [None, *methods]:  # first passes of a shape (oneDNN kernels) untimed
            run_once(target, draft, batch, warm, method)
        one_token = argparse.Namespace(**{**vars(args), "new_tokens": 1})
        for _ in range(args.repeats):  # interleaved, so load changes hit every call alike
            runs["prompt"].append(run_once(target, draft, batch, one_token, None))
            runs["plain"].append(run_once(target, draft, batch, args, None))
            for method in methods:
                runs[method].append(run_once(target, draft, batch, args, method))
        prompt_s = statistics.median(run["seconds"] for run in runs["prompt"])
        if min(run["seconds"] for kind in ("plain", *methods) for run in runs[kind]) <= prompt_s:
            raise SystemExit(f"B={size}: a call took no longer than the prompt's pass alone ({prompt_s:.2f} s): the "
                             "machine's load changed under the run; run again on a quiet machine, or with more "
                             "--new-tokens.")
        plain_tps, plain_after = rates(runs["plain"], size, prompt_s)
        for method in methods:
            spec_tps, spec_after = rates(runs[method], size, prompt_s)
            identical = [a == b for a, b in zip(runs["plain"][0]["sequences"], runs[method][0]["sequences"])]
            row = {"batch": size, "method": method, "plain_tokens_per_s": plain_tps,
                   "speculative_tokens_per_s": spec_tps,
                   "ratio": spec_tps / plain_tps, "prompt_pass_seconds": prompt_s,
                   "plain_tokens_per_s_after_prompt": plain_after, "speculative_tokens_per_s_after_prompt": spec_after,
                   "ratio_after_prompt": spec_after / plain_after,
                   "tokens_per_target_step_per_row": statistics.median(
                       run["tokens_per_target_step_per_row"] for run in runs[method]),
                   "rows_identical": sum(identical), "load_average": os.getloadavg()[0],
                   "runs": {"plain": runs["plain"], "prompt": runs["prompt"], "speculative": runs[method]}}
            rows.append(row)
            last = runs[method][-1]
            print(f"B={size}: plain {plain_tps:.2f} tok/s, {method} {spec_tps:.2f} tok/s, "
                  f"ratio {row['ratio']:.2f} (after the prompt's {prompt_s:.1f} s: {plain_after:.2f} against "
                  f"{spec_after:.2f} tok/s, {row['ratio_after_prompt']:.2f}), "
                  f"tokens/target step/row {row['tokens_per_target_step_per_row']:.2f}, "
                  f"identical rows {sum(identical)}/{size}, load {row['load_average']:.2f}; last run: target steps "
                  f"{last['target_forwards']}, plain {last.get('plain_steps')}, shrunk {last.get('shrunk_steps')}",
                  flush=True)

    machine = {"cpu": cpu_model(), "flags": [flag for flag in FLAGS if flag in cpu_flags()],
               "threads": torch.get_num_threads(), "torch": torch.__version__, "load_average": os.getloadavg()}
    settings = {"methods": methods, "config": json.loads(args.config), "dtype": args.dtype,
                "prepacked_target": args.prepack, "int8_draft": args.int8_draft,
                "new_tokens": args.new_tokens, "repeats": args.repeats, "prompts": f"{prompt_set}, left-padded",
                "decoding": "greedy"}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps({"settings": settings, "machine": machine, "rows": rows}))
    lines = [f"Speculation on a batch: {', '.join(methods)} {args.config}, {args.dtype}"
             f"{', prepacked target' if args.prepack else ''}{', int8 draft' if args.int8_draft else ''}, greedy, "
             f"{args.new_tokens} new "
             f"tokens per row, {prompt_set}; medians of {args.repeats} interleaved runs.",
             f"Machine: {machine['cpu']} ({', '.join(machine['flags'])}), {machine['threads']} threads, load "
             f"{machine['load_average'][0]:.2f}.", "",
             "| batch | method | plain tok/s | speculative tok/s | ratio | prompt pass s | after it: plain tok/s | "
             "after it: speculative tok/s | after it: ratio | tokens / target step / row | identical rows | "
             "plain / shrunk / all target steps per row (last run) | load average |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['method']} | {r['plain_tokens_per_s']:.2f} | {r['speculative_tokens_per_s']:.2f} | "
              f"{r['ratio']:.2f} | {r['prompt_pass_seconds']:.1f} | {r['plain_tokens_per_s_after_prompt']:.2f} | "
              f"{r['speculative_tokens_per_s_after_prompt']:.2f} | {r['ratio_after_prompt']:.2f} | "
              f"{r['tokens_per_target_step_per_row']:.2f} | {r['rows_identical']}/{r['batch']} | "
              f"{steps_cell(r['runs']['speculative'][-1])} | {r['load_average']:.2f} |" for r in rows]
    (args.output / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
