"""`hf-specdec demo`: plain generate against `chain` and `tree` on the real pair, as a small table."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .prompts import humaneval_prompts

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def run_demo(target, draft, tokenizer, prompts: list[str], max_new_tokens: int, methods: list[str]) -> list[dict]:
    """Per method: identical to plain greedy?, tokens/s, median speedup, tokens per target step."""
    rows = {m: {"method": m, "identical": 0, "speedups": [], "tokens": 0, "seconds": 0.0, "tps": []} for m in methods}
    plain_rows = {"tokens": 0, "seconds": 0.0}
    ids0 = tokenizer(prompts[0], return_tensors="pt").input_ids
    target.generate(ids0, max_new_tokens=4, do_sample=False)  # warm-up
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        start = time.perf_counter()
        plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        plain_time = time.perf_counter() - start
        plain_rows["tokens"] += plain.shape[1] - ids.shape[1]
        plain_rows["seconds"] += plain_time
        for method in methods:
            start = time.perf_counter()
            out = target.generate(
                ids,
                assistant_model=draft,
                speculation=method,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
            )
            elapsed = time.perf_counter() - start
            row = rows[method]
            row["identical"] += int(torch.equal(out.sequences, plain))
            row["speedups"].append(
                plain_time / elapsed * (out.sequences.shape[1] - ids.shape[1]) / max(plain.shape[1] - ids.shape[1], 1)
            )
            row["tokens"] += out.sequences.shape[1] - ids.shape[1]
            row["seconds"] += elapsed
            row["tps"].append(out.speculation_stats.mean_tokens_per_step)
    table = [
        {
            "method": "plain generate",
            "identical": f"{len(prompts)}/{len(prompts)}",
            "tokens/s": plain_rows["tokens"] / plain_rows["seconds"],
            "speedup": 1.0,
            "tokens/step": 1.0,
        }
    ]
    for row in rows.values():
        table.append(
            {
                "method": f"speculation={row['method']!r}",
                "identical": f"{row['identical']}/{len(prompts)}",
                "tokens/s": row["tokens"] / row["seconds"],
                "speedup": statistics.median(row["speedups"]),
                "tokens/step": statistics.mean(row["tps"]),
            }
        )
    return table


def format_table(table: list[dict]) -> str:
    header = "| method | identical to plain | tokens/s | speedup (median) | tokens per target step |"
    lines = [header, "|---|---|---|---|---|"]
    for row in table:
        lines.append(
            f"| {row['method']} | {row['identical']} | {row['tokens/s']:.2f} | {row['speedup']:.2f}x | "
            f"{row['tokens/step']:.2f} |"
        )
    return "\n".join(lines)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="Plain generate vs chain vs tree on the embedded real model pair.")
    parser.add_argument("--prompts", type=int, default=3, help="How many HumanEval prompts (default 3).")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--methods", default="chain,tree", help="Comma-separated speculation names.")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from . import models

    print(f"Loading the embedded pair ({args.dtype}) ...", flush=True)
    target, draft, tokenizer = models.load_default_pair(dtype=DTYPES[args.dtype])
    prompts = humaneval_prompts(args.prompts)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    print(
        f"{len(prompts)} HumanEval prompts x {args.max_new_tokens} new tokens, greedy, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    table = run_demo(target, draft, tokenizer, prompts, args.max_new_tokens, methods)
    print(format_table(table))
    return 0
