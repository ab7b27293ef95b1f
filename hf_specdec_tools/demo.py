"""`hf-specdec demo`: plain `generate` against our methods on the embedded real pair, as a small table.

It is the benchmark harness (`hf-specdec bench`) with a small preset: a few HumanEval prompts, greedy, outputs
checked token-identical to plain, every figure a ratio against plain on the same prompt in the same run.
"""

from __future__ import annotations

import argparse
import sys

from .bench.cli import PLAIN_BFLOAT16_HELP, QUANTIZE_CHOICES

DTYPES = ("auto", "bfloat16", "float32")
DEFAULT_METHODS = "chain,tree,sequoia,specexec"


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="Plain generate vs chain, tree, sequoia and specexec on the embedded real model pair."
    )
    parser.add_argument("--prompts", type=int, default=3, help="How many HumanEval prompts (default 3).")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto (default): bfloat16 where the hardware multiplies it natively, else float32.")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"Comma-separated (default {DEFAULT_METHODS}).")
    parser.add_argument("--int8-draft", action=argparse.BooleanOptionalAction, default=None,
                        help="Draft with a quantized copy of the draft model (hf_specdec.quantize_draft's default: "
                        "int4 for narrow passes and int8 for wide ones on a CPU with native bfloat16, else int8; "
                        "default: on a CPU).")
    parser.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None,
                        help="Prepack the models' Linear weights for this CPU where that measures faster "
                        "(hf_specdec.prepack; default: on a CPU). Plain generate runs on the same prepared models.")
    parser.add_argument("--quantize-target", choices=QUANTIZE_CHOICES, default=None, metavar="ROUTE",
                        help="auto (default on a CPU): time the target unquantized and through each available "
                        "quantization route that keeps a tree pass's rows (torchao int8) and keep the fastest; or "
                        "name one: "
                        f"{', '.join(QUANTIZE_CHOICES)}. Plain generate runs on the same target.")
    parser.add_argument("--draft-vocabulary", type=int, metavar="K",
                        help="Restrict the draft's output layer to its K most frequent tokens (hf_specdec."
                        "restrict_vocabulary): cheaper draft passes, same outputs.")
    parser.add_argument("--remeasure", action="store_true",
                        help="Time the automatic choices (quantization route, prepacking) again instead of reusing "
                        "what an earlier run measured on this machine (saved in the cache folder).")
    parser.add_argument("--plain-bfloat16", action=argparse.BooleanOptionalAction, default=None,
                        help=PLAIN_BFLOAT16_HELP)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from hf_specdec.runtime.model_info import quantization

    from .bench.cli import add_plain_bfloat16_row, benchmark, report_loading, resolve_dtype
    from .bench.inputs import load_prompt_source, tokenize_prompts
    from .bench.loading import load_models
    from .bench.report import markdown_table
    from .bench.runner import BenchSettings
    from .bench.strategies import StrategyError, resolve_strategies

    try:
        strategies = resolve_strategies([m.strip() for m in args.methods.split(",") if m.strip()])
        if args.prompts < 1 or args.max_new_tokens < 1:
            raise ValueError("--prompts and --max-new-tokens must be at least 1.")
    except (StrategyError, ValueError) as error:
        print(f"hf-specdec demo: error: {error}", file=sys.stderr)
        return 2
    dtype = resolve_dtype(args.dtype)
    int8_draft = args.int8_draft if args.int8_draft is not None else not torch.cuda.is_available()
    prepack = args.prepack if args.prepack is not None else not torch.cuda.is_available()
    quantize_target = args.quantize_target or ("none" if torch.cuda.is_available() else "auto")
    print(f"Loading the embedded pair ({dtype}) ...", flush=True)
    try:
        loaded = load_models(dtype=getattr(torch, dtype), int8_draft=int8_draft, prepack=prepack,
                             quantize_target=quantize_target, remeasure=args.remeasure,
                             draft_vocabulary=args.draft_vocabulary)
    except (ValueError, ImportError) as error:
        print(f"hf-specdec demo: error: {error}", file=sys.stderr)
        return 2
    report_loading(loaded.info)
    prompts = tokenize_prompts(loaded.tokenizer, load_prompt_source(f"humaneval:{args.prompts}"))
    kind = quantization(loaded.draft) if loaded.draft is not None else None
    draft_kind = f", draft {kind}" if kind else ""
    print(f"{args.prompts} HumanEval prompts x {args.max_new_tokens} new tokens, greedy, {torch.get_num_threads()} "
          f"threads, {dtype}{draft_kind}", flush=True)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens)
    results = benchmark(loaded, prompts, strategies, settings, True)
    add_plain_bfloat16_row(results, loaded, prompts, settings, args.plain_bfloat16, dtype, True)
    print(markdown_table(results["summary"]))
    for call in results["calls"]:
        if call.get("difference"):
            print(difference_line(call, str(dtype).removeprefix("torch.")), flush=True)
    for call in results["calls"]:
        source = (call.get("speculation_stats") or {}).get("plan_source")
        if source and call["prompt"] == 0:
            print(f"{call['strategy']}: {source}")
    return 0


def difference_line(call: dict, dtype: str) -> str:
    """Why a greedy call left plain's output: a near-tie of the dtype's rounding, or a fault to report."""
    difference = call["difference"]
    where = f"`{call['strategy']}` left plain on prompt {call['prompt'] + 1} at new token {difference['new_token']}"
    margin, step = difference["margin"], difference["rounding_step"]
    if margin is None:
        return f"{where}: it stopped at another length."
    judged = (f"a near-tie in {dtype}, whose tree passes round differently from "
              "one-token passes; float32 output is identical" if difference["near_tie"]
              else "wider than rounding: a fault, please report it")
    return (f"{where}: plain's own pass put its token {margin:.4g} above the other (one rounding step: {step:.4g}), "
            f"{judged}.")

