"""`hf-specdec calibrate`: measure a pair, plan its Sequoia tree, check the prediction, write the plan and plots."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float32", "float16")


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate",
        help="Measure acceptance and latency for a target/draft pair and plan its Sequoia tree.",
        description=(
            "Decodes the target's own continuations of the prompts (losslessly), estimates the acceptance vector "
            "teacher-forced, measures both models' forward time against tree size, picks the tree size and depth "
            "that minimise predicted time per token, then decodes held-out prompts to compare prediction and "
            "measurement. Writes a JSON plan (never pickle) and PNG plots."
        ),
    )
    parser.add_argument("--target", help="Target model folder or Hub id (default: the embedded Qwen2.5-Coder 1.5B).")
    parser.add_argument("--draft", help="Draft model folder or Hub id (default: the embedded Qwen2.5-Coder 0.5B).")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--prompts", default="humaneval:10",
                        help="humaneval[:N], or a .jsonl/.json/.txt file of prompts or chats (default humaneval:10).")
    parser.add_argument("--held-out", type=int, default=2,
                        help="The last K prompts are decoded to check the prediction, not calibrated on (default 2).")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples.")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--verifier", default=None, help="Default: greedy at temperature 0, else sequoia.")
    parser.add_argument("--width", type=int, default=16, help="Ranks in the acceptance vector (default 16).")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-budget", type=int, default=128, help="Largest tree considered (nodes incl. the root).")
    parser.add_argument("--max-depth", type=int, default=12, help="Most levels considered (root included).")
    parser.add_argument("--offload-max-memory", default=None,
                        help="Load the target offloaded (accelerate device_map='auto'), keeping this much in RAM.")
    parser.add_argument("--output", type=Path, help="Write the plan here (JSON).")
    parser.add_argument("--save", action="store_true",
                        help="Also store the plan where speculation='sequoia' finds it for this pair on this machine.")
    parser.add_argument("--plots", type=Path, help="Folder for PNG plots (default: next to --output).")
    parser.add_argument("--quiet", action="store_true", help="No progress bars.")
    parser.set_defaults(func=run)
    return parser


def _check(args: argparse.Namespace) -> None:
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}.")
    if args.width < 1 or args.max_new_tokens < 1 or args.max_budget < 1 or args.max_depth < 1:
        raise ValueError("--width, --max-new-tokens, --max-budget and --max-depth must all be >= 1.")
    if args.held_out < 0:
        raise ValueError(f"--held-out must be >= 0, got {args.held_out}.")
    if not (args.output or args.save):
        raise ValueError("Say where the plan goes: --output FILE, --save (this machine's plan store), or both.")


def run(args: argparse.Namespace) -> int:
    import torch

    from hf_specdec.methods.sequoia.calibrate import calibrate, evaluate_plan
    from hf_specdec.methods.sequoia.store import save_user_plan
    from hf_specdec.runtime.paths import CACHE_ENV

    from .bench.inputs import load_prompt_source, tokenize_prompts
    from .bench.loading import load_models
    from .plots import plot_all

    try:
        _check(args)
        prompts = load_prompt_source(args.prompts)
        if len(prompts) <= args.held_out:
            raise ValueError(f"{len(prompts)} prompt(s) leave none to calibrate on after --held-out {args.held_out}.")
    except ValueError as exc:
        print(f"hf-specdec calibrate: error: {exc}", file=sys.stderr)
        return 2
    progress = not args.quiet
    loaded = load_models(args.target, args.draft, dtype=getattr(torch, args.dtype),
                         offload=args.offload_max_memory is not None, offload_max_memory=args.offload_max_memory)
    try:
        ids = tokenize_prompts(loaded.tokenizer, prompts)
        calibration, held_out = ids[: len(ids) - args.held_out], ids[len(ids) - args.held_out :]
        plan = calibrate(loaded.target, loaded.draft, calibration, temperature=args.temperature, verifier=args.verifier,
                         width=args.width, max_new_tokens=args.max_new_tokens, max_budget=args.max_budget,
                         max_depth=args.max_depth, top_k=args.top_k, top_p=args.top_p, progress=progress)
        if held_out:
            plan.measured = evaluate_plan(plan, loaded.target, loaded.draft, held_out, args.max_new_tokens,
                                          progress=progress)
        written = []
        if args.output:
            written.append(plan.save(args.output))
        if args.save:
            saved = save_user_plan(plan, loaded.target, loaded.draft)
            if saved is None:  # the store warned where and why; a command asked to save must not end quietly
                raise SystemExit(f"The plan was not saved: set {CACHE_ENV} to a writable folder, or pass --output.")
            written.append(saved)
        plots = plot_all(plan, args.plots or (args.output.parent if args.output else written[0].parent) / "plots")
    finally:
        loaded.cleanup()
    _summary(plan, written, plots)
    return 0


def _summary(plan, written: list[Path], plots: list[Path]) -> None:
    print(f"acceptance by rank: {[round(p, 3) for p in plan.acceptance]} ({plan.acceptance_positions} positions)")
    print(f"tree: {len(plan.parents)} nodes, widths per level {plan.tree.widths_per_level()}")
    predicted = plan.predicted
    ms = predicted["seconds_per_token"] * 1000
    print(f"predicted: {predicted['tokens_per_step']:.2f} tokens/step, {ms:.1f} ms/token")
    if plan.measured:
        measured = plan.measured
        print(f"measured on {measured['prompts']} held-out prompt(s): {measured['tokens_per_step']:.2f} tokens/step, "
              f"{measured['seconds_per_token'] * 1000:.1f} ms/token")
        print(json.dumps(measured["trees"], indent=1))
    for path in written:
        print(f"plan written to {path}")
    for path in plots:
        print(f"plot: {path}")
