"""`hf-specdec bench`: every strategy against Transformers' own options, and `hf-specdec bench report` to redraw
a results.json (and README's Results section) without models."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA = "hf_specdec.bench/1"
DTYPES = ("auto", "bfloat16", "float32", "float16")
#: target_quantization.CHOICES, spelled out so that `--help` imports no model code (a test keeps them equal)
QUANTIZE_CHOICES = ("none", "auto", "int8", "int8-dynamic")
#: hf_specdec.kernels.quantize.SCHEMES, spelled out for the same reason (the same test keeps them equal)
DRAFT_SCHEMES = ("dynamic-int8", "int4", "int8-weight-only", "mixed")
DEFAULT_PROMPTS, QUICK_PROMPTS = "humaneval:8", "humaneval:3"
DEFAULT_NEW_TOKENS, QUICK_NEW_TOKENS = 128, 48
#: --quick starts no prompt that would end past this; loading the models and the report take the rest of 10 min
QUICK_MAX_MINUTES = 8.5


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` command (and its `report` sub-command) to the `hf-specdec` sub-command parsers."""
    parser = subparsers.add_parser(
        "bench",
        help="Benchmark every strategy against plain generate and Transformers' assisted / prompt-lookup decoding.",
        description=(
            "Runs plain generate, Transformers' assisted generation and prompt lookup, and every registered "
            "speculation method in one process, interleaved per prompt after a warm-up, and writes results.json "
            "(every raw number and the machine), results.md and PNG plots. `hf-specdec bench report RESULTS.json` "
            "redraws them and can rewrite README's Results section."
        ),
    )
    parser.add_argument(
        "--strategy", action="append", metavar="NAME[:key=value,...]",
        help="Repeatable. A baseline (plain, hf-assisted, hf-assisted-static on Transformers 5.24+, hf-prompt-lookup) "
        "or a registered method; settings become "
        "speculation_config= (e.g. specexec:budget=128,width=4, tree:widths=[4,2,1]). Default: all of them "
        "(plain is always run). See --list-strategies.",
    )
    parser.add_argument("--list-strategies", action="store_true", help="Print the known strategy names and exit.")
    parser.add_argument("--target", help="Target folder or Hub id (default: the embedded Qwen2.5-Coder-1.5B).")
    parser.add_argument("--draft", help="Draft folder or Hub id (default: the embedded Qwen2.5-Coder-0.5B).")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None,
        help="Both models' dtype. auto: bfloat16 where the hardware multiplies it natively (GPUs, CPUs with "
        "AVX512-BF16/AMX), else float32, which is faster there. Default bfloat16 (auto with --quick).",
    )
    parser.add_argument(
        "--prompts", default=None,
        help="humaneval (all 164), humaneval:N, code[:N] (continuations cut from the standard library's functions), "
        "rewrite[:N] (chats whose answers repeat their input), chat[:N] (general chat: multi-turn, translation, "
        "summarization, QA, math, a long retrieved context), or a "
        ".jsonl/.json/.txt file (chats use the chat template). "
        f"Default {DEFAULT_PROMPTS} ({QUICK_PROMPTS} with --quick).",
    )
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"Default {DEFAULT_NEW_TOKENS} ({QUICK_NEW_TOKENS} with --quick).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, outputs checked token-identical to plain; > 0: sample, "
                        "seeded per prompt.")
    parser.add_argument("--top-k", type=int, default=None,
                        help="With --temperature: generate's top_k for every strategy (default: the generation "
                        "config's, 50; 0 turns it off).")
    parser.add_argument("--top-p", type=float, default=None,
                        help="With --temperature: generate's top_p for every strategy (default: the generation "
                        "config's, 1.0).")
    parser.add_argument("--seed", type=int, default=0,
                        help="torch.manual_seed(SEED + prompt index) before each call (default 0).")
    parser.add_argument("--offload", action="store_true",
                        help="Load the target with accelerate device_map='auto', most layers on disk (plain too).")
    parser.add_argument("--offload-max-memory", metavar="SIZE",
                        help="RAM kept for the offloaded target, e.g. 900MiB (default: half its weight bytes, "
                        "which keeps about a quarter of its layers in RAM).")
    parser.add_argument("--int8-draft", action=argparse.BooleanOptionalAction, default=None,
                        help="Quantize the draft's Linear layers (hf_specdec.quantize_draft, as --draft-scheme says): "
                        "a cheaper draft on CPUs, same outputs. Transformers' assisted generation gets the same draft. "
                        "Default: off (on with --quick on a CPU).")
    parser.add_argument("--draft-scheme", choices=("auto", *DRAFT_SCHEMES), default="auto",
                        help="How --int8-draft quantizes the draft (hf_specdec.quantize_draft's scheme): auto "
                        "(default: mixed on a CPU with native bfloat16, else dynamic-int8), dynamic-int8, int4 or "
                        "int8-weight-only (weight-only, bfloat16 activations), mixed (int4 for passes of few rows "
                        "where it measures faster, dynamic int8 for wider ones).")
    parser.add_argument("--draft-vocabulary", type=int, metavar="K",
                        help="Restrict the draft's output layer to the K tokens most frequent in text disjoint from "
                        "the prompts (hf_specdec.restrict_vocabulary, FR-Spec): cheaper draft passes, same outputs. "
                        "Transformers' assisted generation gets the same draft.")
    parser.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None,
                        help="Prepack both models' Linear weights for this CPU (hf_specdec.prepack), kept only where "
                        "measured faster; every strategy, plain generate included, runs on the prepared models "
                        "(default: on a CPU).")
    parser.add_argument("--remeasure", action="store_true",
                        help="Time the automatic choices (--quantize-target auto, --prepack) again instead of reusing "
                        "what an earlier run measured on this machine.")
    parser.add_argument("--quantize-target", choices=QUANTIZE_CHOICES, default=None, metavar="ROUTE",
                        help="Load the target quantized through a Transformers route: int8 (torchao weight-only), "
                        "int8-dynamic (torchao; its int8 activations widen bfloat16's rounding gap between a tree pass "
                        "and one-token passes, so greedy outputs may leave plain's), none, or auto (time the target "
                        "unquantized and through each route that keeps that gap, int8, and keep the fastest). Plain "
                        "generate runs on the same quantized target, so outputs are still compared token for token. "
                        "Default none.")
    parser.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=None,
                        help="Add a llama.cpp reference row (plain decoding of the embedded target's original "
                        "Q4_K_M GGUF through llama-cpp-python, same prompts and threads). Default: when the extra "
                        "is installed and the target is the embedded one; skipped with the reason otherwise.")
    parser.add_argument("--plain-bfloat16", action=argparse.BooleanOptionalAction, default=None,
                        help=PLAIN_BFLOAT16_HELP)
    parser.add_argument("--plain-one-row-packing", action="store_true",
                        help="Add a reference row: plain generate on the prepacked target repacked for one-token "
                        "passes (the fastest plain decoding on some CPUs; the other rows share the 16-row packing), "
                        "run after the other rows; the target is packed back afterwards.")
    parser.add_argument("--repeats", type=int, default=1,
                        help="Measured calls per prompt and strategy; their median counts (default 1).")
    parser.add_argument("--bracket-plain", action="store_true",
                        help="Run plain first and last on every prompt (and repeat), the other strategies between; "
                        "ratios divide by the mean of plain's two calls, which a machine whose speed drifts within a "
                        "set needs (one plain call's minute otherwise decides a prompt's ratio).")
    parser.add_argument("--warmup", type=int, default=1, help="Unmeasured short calls per strategy first (default 1).")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="Start no prompt that would end past this many minutes (warm-up included); the "
                        f"prompts measured by then are reported. Default none ({QUICK_MAX_MINUTES:g} with --quick).")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice).")
    parser.add_argument("--output", type=Path, help="Results folder (default bench-results/<timestamp>).")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"Under 10 minutes on any machine: up to {QUICK_PROMPTS}, {QUICK_NEW_TOKENS} new tokens, the dtype "
        f"this hardware runs fastest (--dtype auto), an int8 draft on CPUs, and stops after {QUICK_MAX_MINUTES:g} "
        "minutes; plain, hf-assisted, hf-prompt-lookup, specexec (+ sequoia, staged when registered).",
    )
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")
    parser.set_defaults(func=run)

    commands = parser.add_subparsers(
        dest="bench_command", metavar="SUBCOMMAND", title="optional sub-command (without one, the benchmark runs)"
    )
    report = commands.add_parser(
        "report", help="Redraw results.md and plots from a results.json; optionally rewrite README's Results.",
        description="Redraws results.md and the PNG plots next to RESULTS (no models needed). With --readme, "
        "replaces the region between <!-- bench-results:start --> and <!-- bench-results:end --> with the table, "
        "the machine and settings lines and links to the plots.",
    )
    report.add_argument("results", type=Path, metavar="RESULTS", help="A results.json written by `hf-specdec bench`.")
    report.add_argument("--readme", type=Path, metavar="README", help="Markdown file whose results region to rewrite.")
    report.set_defaults(func=run_report)
    return parser


PLAIN_BFLOAT16_HELP = (
    "Add a reference row: plain generate on the target loaded in bfloat16, after the other rows. Default: on for a "
    "float32 run on a CPU without native bfloat16 (target neither offloaded nor quantized), where a one-token "
    "bfloat16 pass is cheaper than a float32 one and plain bfloat16 may be a user's fastest option.")


def _error(message: str) -> int:
    print(f"hf-specdec bench: error: {message}", file=sys.stderr)
    return 2


def run_report(args: argparse.Namespace) -> int:
    from .readme import ReadmeError, update_readme
    from .report import load_json, write_report

    try:
        results = load_json(args.results)
        paths = write_report(results, args.results.parent, with_json=False)
        if args.readme:
            paths["readme"] = update_readme(args.readme, args.results)
    except (ValueError, FileNotFoundError, ReadmeError) as error:
        return _error(str(error))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Resolve everything cheap first (strategies, prompts) so a typo fails before the models load."""
    import torch

    from .inputs import PromptError, load_prompt_source, tokenize_prompts
    from .loading import load_models
    from .runner import BenchSettings
    from .strategies import StrategyError, known_strategies, resolve_strategies

    if args.list_strategies:
        print("\n".join(known_strategies()))
        return 0
    if args.llama_cpp and (why := llama_cpp_unavailable(args.target, args.temperature > 0)):
        return _error(f"--llama-cpp cannot run: {why}.")
    dtype_name = resolve_dtype(args.dtype or ("auto" if args.quick else "bfloat16"))
    int8_draft = args.int8_draft if args.int8_draft is not None else args.quick and not torch.cuda.is_available()
    prepack = args.prepack if args.prepack is not None else not torch.cuda.is_available()
    max_minutes = args.max_minutes if args.max_minutes is not None else QUICK_MAX_MINUTES if args.quick else None
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens or (QUICK_NEW_TOKENS if args.quick else DEFAULT_NEW_TOKENS),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        max_seconds=None if max_minutes is None else max_minutes * 60,
        bracket_plain=args.bracket_plain,
    )
    prompt_spec = args.prompts or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS)
    try:
        settings.validate()
        strategies = resolve_strategies(args.strategy, quick=args.quick)
        prompts = load_prompt_source(prompt_spec)
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be at least 1, got {args.threads}.")
            torch.set_num_threads(args.threads)
        if args.offload_max_memory and not args.offload:
            raise ValueError("--offload-max-memory needs --offload.")
    except (StrategyError, PromptError, ValueError, ImportError) as error:
        return _error(str(error))
    output = args.output or Path("bench-results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")

    print(f"Loading models ({dtype_name}{', target offloaded' if args.offload else ''}) ...", file=sys.stderr)
    try:
        loaded = load_models(
            args.target, args.draft, dtype=getattr(torch, dtype_name), need_draft=any(s.uses_draft for s in strategies),
            offload=args.offload, offload_max_memory=args.offload_max_memory, int8_draft=int8_draft,
            prepack=prepack, quantize_target=args.quantize_target, progress=not args.no_progress,
            remeasure=args.remeasure, draft_vocabulary=args.draft_vocabulary, draft_scheme=args.draft_scheme,
        )
    except (ValueError, ImportError) as error:
        return _error(str(error))
    report_loading(loaded.info)
    try:
        try:
            input_ids = tokenize_prompts(loaded.tokenizer, prompts)
        except PromptError as error:
            return _error(str(error))
        results = benchmark(loaded, input_ids, strategies, settings, not args.no_progress)
        add_llama_cpp_row(results, input_ids, settings, args.llama_cpp, args.target, not args.no_progress)
        add_plain_bfloat16_row(results, loaded, input_ids, settings, args.plain_bfloat16, dtype_name,
                               not args.no_progress)
        if args.plain_one_row_packing:
            add_one_row_packing_row(results, loaded.target, input_ids, settings, not args.no_progress)
    finally:
        loaded.cleanup()
    results["settings"].update(
        prompts=prompt_spec, dtype=dtype_name, dtype_requested=args.dtype, offload=args.offload,
        offload_max_memory=args.offload_max_memory, threads=args.threads, quick=args.quick, target=args.target,
        draft=args.draft, int8_draft=int8_draft, draft_scheme=loaded.info["draft_quantization"] if int8_draft else None,
        draft_vocabulary=args.draft_vocabulary, prepack=prepack,
        quantize_target=args.quantize_target,
        command=" ".join(["hf-specdec", *sys.argv[1:]]) if sys.argv else None,
    )
    from .report import markdown_table, write_report

    if results.get("interrupted"):
        print("Interrupted: writing the prompts every strategy finished.", file=sys.stderr)
    paths = write_report(results, output)
    print(markdown_table(results["summary"]))
    print(f"\nWrote {', '.join(str(p) for p in paths.values())}")
    return 0


def report_loading(info: dict[str, Any]) -> None:
    """Say what the automatic choices picked, and why (prepacking, the target's quantization route)."""
    if info.get("remembered"):
        print(f"automatic choices as measured on this machine on {info['remembered']} (saved in the cache folder; "
              "--remeasure times them again)", file=sys.stderr)
    for role, report in info.get("kernels", {}).items():
        timing = (f" (ms per pass over 1/16 tokens: {report['ms_before']} -> {report['ms_after']})"
                  if report.get("ms_before") else "")
        print(f"{role}: {report['reason']}{timing}", file=sys.stderr)
    from .report import route_timings

    quantized = info.get("target_quantization") or {}
    if quantized.get("ms_per_pass_by_route"):
        print(f"target quantization: picked {quantized['route']} ({quantized['description']}), the fastest pass "
              f"over 1/16 tokens here ({route_timings(quantized['ms_per_pass_by_route'])})", file=sys.stderr)
    elif quantized.get("route", "none") != "none":
        print(f"target quantization: {quantized['description']}", file=sys.stderr)


def add_llama_cpp_row(results: dict[str, Any], input_ids: list, settings: Any, wanted: bool | None,
                      target: str | None, progress: bool) -> None:
    """Append llama.cpp's plain decoding of the embedded target's GGUF as a reference row, or say why not."""
    from . import llama_cpp

    if wanted is False:
        return
    found = {}

    def run(measured: list[int]) -> list[dict[str, Any]]:
        from .. import models

        found["gguf"] = models.fetch_gguf(models.DEFAULT_TARGET, progress)
        calls = llama_cpp.run_llama_cpp(found["gguf"], [input_ids[i] for i in measured], settings.max_new_tokens,
                                        progress=progress)
        for call, prompt in zip(calls, measured):
            call["prompt"] = prompt
        return calls

    calls = run_reference_row(results, "llama_cpp", "llama.cpp", llama_cpp_unavailable(target, settings.sampling), run)
    if calls is not None:
        append_reference_row(results, calls, llama_cpp.reference_strategy(found["gguf"]), settings)
        results["llama_cpp"] = {"gguf": found["gguf"].name, "version": llama_cpp.version()}


def add_plain_bfloat16_row(results: dict[str, Any], loaded: Any, input_ids: list, settings: Any, wanted: bool | None,
                           dtype_name: str, progress: bool) -> None:
    """Append plain `generate` on a bfloat16 copy of the target as a reference row (`bf16_reference`), when asked or
    by default on a CPU without native bfloat16 (`loaded.info`: was the target offloaded or quantized); say why not
    where it cannot run."""
    from . import bf16_reference

    route = (loaded.info.get("target_quantization") or {}).get("route", "none")
    if wanted is False or (wanted is None and not bf16_reference.wanted_by_default(
            dtype_name, bool(loaded.info.get("offload")), route)):
        return
    calls = run_reference_row(
        results, "plain_bfloat16", bf16_reference.LABEL, None,
        lambda measured: bf16_reference.run_plain_bfloat16(loaded.info["target"]["source"],
                                                           {i: input_ids[i] for i in measured}, settings, progress))
    if calls is not None:
        append_reference_row(results, calls, bf16_reference.reference_strategy(), settings)
        results["plain_bfloat16"] = {"source": loaded.info["target"]["source"]}


def add_one_row_packing_row(results: dict[str, Any], target: Any, input_ids: list, settings: Any,
                            progress: bool) -> None:
    """Append plain `generate` on the target repacked for one-token passes as a reference row (`packing_reference`);
    say why not where it cannot run."""
    from . import packing_reference

    calls = run_reference_row(
        results, "plain_one_row_packing", packing_reference.LABEL, packing_reference.unavailable(target),
        lambda measured: packing_reference.run_plain_one_row(target, {i: input_ids[i] for i in measured}, settings,
                                                             progress))
    if calls is not None:
        append_reference_row(results, calls, packing_reference.reference_strategy(), settings)
        results["plain_one_row_packing"] = {"rows_hint": 1}


def run_reference_row(results: dict[str, Any], key: str, label: str, why: str | None,
                      run: Callable[[list[int]], list[dict[str, Any]]]) -> list[dict[str, Any]] | None:
    """The calls of an optional row run after the measured ones, on the prompts they measured; None (and the reason
    printed and kept under `results[key]`) where it cannot run or fails: such a row never costs the run before it."""
    measured = sorted({call["prompt"] for call in results["calls"]})
    if why is None and (results.get("interrupted") or not measured):
        why = "the run was interrupted" if results.get("interrupted") else "no prompt was measured"
    if why is None:
        try:
            return run(measured)
        except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - reported in the results instead
            why = f"it failed ({type(error).__name__}: {error})"
    print(f"{label} row skipped: {why}.", file=sys.stderr)
    results[key] = {"skipped": why}
    return None


def append_reference_row(results: dict[str, Any], calls: list[dict[str, Any]], strategy: dict[str, Any],
                         settings: Any) -> None:
    """A row run after the measured ones (another engine or dtype): its calls, its strategy, the summary again."""
    from .aggregate import summarize

    results["calls"] += calls
    results["strategies"].append(strategy)
    results["summary"] = summarize(results["calls"], results["strategies"], sampling=settings.sampling)


def llama_cpp_unavailable(target: str | None, sampling: bool) -> str | None:
    """Why the llama.cpp row cannot run in this benchmark, or None."""
    import torch

    from . import llama_cpp

    if target is not None:
        return "--target is not the embedded model, whose GGUF file the row reads"
    if sampling:
        return "the row decodes greedily; this run samples"
    if torch.cuda.is_available():
        return "the row runs llama.cpp on the CPU, and this run's target is on a GPU"
    return llama_cpp.unavailable()


def resolve_dtype(name: str) -> str:
    """`auto` -> bfloat16 where matmuls in it are native (a CUDA GPU that supports it, a CPU with AVX512-BF16 or
    AMX), else float32: without native support a bfloat16 pass over n tokens costs about n single-token passes."""
    if name != "auto":
        return name
    import torch

    from hf_specdec.runtime.devices import native_bfloat16

    return "bfloat16" if native_bfloat16(torch.cuda.is_available()) else "float32"


def benchmark(loaded: Any, input_ids: list, strategies: list, settings: Any, progress: bool) -> dict[str, Any]:
    """The run plus what makes its numbers meaningful: schema, machine (load at start and end) and models."""
    from .environment import collect_environment
    from .runner import run_benchmark

    environment = collect_environment()
    run = run_benchmark(loaded.target, loaded.draft, input_ids, strategies, settings, progress=progress)
    if hasattr(os, "getloadavg"):
        environment["load_average_end"] = list(os.getloadavg())
    return {"schema": SCHEMA, "environment": environment, "models": loaded.info, **run}
