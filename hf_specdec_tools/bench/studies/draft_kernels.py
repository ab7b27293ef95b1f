"""The draft's kernels on whole passes: ms per draft pass over 1-32 rows for each way to run the 0.5B draft.

    nice .venv/bin/python -m hf_specdec_tools.bench.studies.draft_kernels --output benchmarks/results/zen4/draft-kernels

Variants of the embedded draft, all in one process: `quantize_draft`'s schemes ("dynamic-int8": fbgemm int8,
activations per tensor; "int4" and "int8-weight-only": aten's fused weight-only CPU kernels, bfloat16
activations; "mixed", the default where bfloat16 is native: int4 for narrow passes, int8 for wide ones), the draft
in the target's dtype prepacked with `hf_specdec.prepack`, torchao's int8 weight-only config (with `--torchao`), and
one scheme with its output layer over the 65,536 most frequent tokens (`--subset-of`). Pass times are interleaved:
every round times every variant (and the prepacked target over 1 and 16 tokens) after 256 cached tokens,
median of 3 passes; the figure is the median over rounds, and draft/target is the ratio within this process.
Acceptance is counted, not timed (load does not change it), for today's draft and every variant faster than it at
some pass size: greedy `chain` (4 tokens) and `specexec` (a fixed 32-token tree) on HumanEval prompts, every step
speculating, outputs checked identical to plain `generate`.
Writes results.json (machine, settings, every figure) and README.md (the tables). `--dtype auto` (default) takes the
dtype `hf-specdec bench --dtype auto` would: bfloat16 where this CPU multiplies it natively, else float32.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import warnings
from pathlib import Path

import torch

from hf_specdec import frequent_tokens, prepack, quantize_draft
from hf_specdec.accept.kv_cache import crop
from hf_specdec.core.releases import cache_arg, output_cache
from hf_specdec.plan.latency import measure_latency
from hf_specdec_tools import models
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.prompts import held_out_corpus, humaneval_prompts

ROWS = (1, 2, 4, 8, 16, 32)
METHODS = {"chain": {"guard": False}, "specexec": {"budget": 32, "guard": False}}


def torchao_int8_weight_only(draft):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = copy.deepcopy(draft).eval()
    quantize_(model, Int8WeightOnlyConfig())
    return model


def release_memory() -> None:
    """Hand freed heap back to the system (the float32 copies quantizing makes), on glibc; elsewhere a no-op."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_variants(draft, tokenizer, subset_of: str, subset: int, torchao: bool) -> dict[str, torch.nn.Module]:
    prepacked = copy.deepcopy(draft).eval()
    packed = prepack(prepacked, measure=False).packed
    dense = f"{str(draft.dtype).removeprefix('torch.')}{'-prepacked' if packed else ''}"
    variants = {"dynamic-int8": quantize_draft(draft, scheme="dynamic-int8"), dense: prepacked}
    for scheme in ("int4", "int8-weight-only", "mixed"):
        release_memory()
        variants[scheme] = quantize_draft(draft, scheme=scheme)
    if torchao:
        variants["torchao-int8-weight-only"] = torchao_int8_weight_only(draft)
    keep = frequent_tokens(tokenizer, held_out_corpus(), subset)
    variants[f"{subset_of} + vocabulary {subset}"] = quantize_draft(draft, vocabulary=keep, scheme=subset_of)
    release_memory()
    return variants


def pass_times(models_: dict[str, torch.nn.Module], rounds: int) -> dict[str, dict[int, float]]:
    """ms per pass, median over `rounds` interleaved rounds (each the median of 3 passes)."""
    per_round: dict[str, list[tuple[float, ...]]] = {name: [] for name in models_}
    for _ in range(rounds):
        for name, model in models_.items():
            sizes = (1, 16) if name == "target" else ROWS
            curve = measure_latency(model, sizes, past_length=256, repeats=3, progress=False, stop_ratio=None)
            per_round[name].append(dict(zip(curve.sizes, curve.seconds)))
    return {name: {n: round(statistics.median(r[n] for r in runs) * 1000, 2) for n in runs[0]}
            for name, runs in per_round.items()}


def acceptance(target, drafts, prompts, max_new_tokens: int) -> dict[str, dict[str, float]]:
    """Median tokens per target pass and draft passes per step, per draft and method (outputs checked)."""
    counts: dict[str, dict[str, list[tuple[float, float]]]] = {name: {m: [] for m in METHODS} for name in drafts}
    for ids in prompts:
        plain = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        for name, draft in drafts.items():
            for method, settings in METHODS.items():
                out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config=settings,
                                      do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
                assert torch.equal(out.sequences, plain), f"{name} / {method}: output differs from plain generate"
                stats = out.speculation_stats
                counts[name][method].append((stats.new_tokens / stats.target_forwards,
                                             stats.draft_forwards / stats.target_forwards))
    return {name: {f"{m} {what}": round(statistics.median(c[i] for c in runs), 2)
                   for m, runs in by_method.items() for i, what in enumerate(("tokens/step", "draft passes/step"))}
            for name, by_method in counts.items()}


def profile_one_row(model, top: int = 8) -> list[tuple[str, float]]:
    """Share of self CPU time per op over 10 one-row passes (where a pass's time goes)."""
    ids = torch.randint(3, 40, (1, 256))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, step = output_cache(out), ids[:, -1:]
        with torch.profiler.profile() as prof:
            for _ in range(10):
                model(input_ids=step, **cache_arg(cache), use_cache=True)
                crop(cache, 256)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, round(e.self_cpu_time_total / total, 3)) for e in events[:top]]


def tables(times, target_ms, target_kind: str, accept) -> list[str]:
    lines = ["| draft | " + " | ".join(f"{n} rows" for n in ROWS) + " | 1 row / target(1) | 16 rows / 1 row |",
             "|---|" + "---|" * (len(ROWS) + 2)]
    for name, ms in times.items():
        lines.append(f"| {name} | " + " | ".join(str(ms[n]) for n in ROWS) +
                     f" | {ms[1] / target_ms[1]:.3f} | {ms[16] / ms[1]:.2f} |")
    lines += ["", f"Target ({target_kind}): {target_ms[1]} ms over 1 token, {target_ms[16]} over 16.", ""]
    heads = list(next(iter(accept.values())))
    lines += ["| draft | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    lines += [f"| {name} | " + " | ".join(str(row[h]) for h in heads) + " |" for name, row in accept.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/draft-kernels"))
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved timing rounds.")
    parser.add_argument("--prompts", type=int, default=3, help="HumanEval prompts for the acceptance counts.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--subset-of", default="dynamic-int8", help="Scheme given the vocabulary subset.")
    parser.add_argument("--subset", type=int, default=65536, help="Tokens kept in the subset's output layer.")
    parser.add_argument("--torchao", action="store_true", help="Add torchao's Int8WeightOnlyConfig (dequantizes "
                        "the whole weight on every call in 0.18: slow, and 0.8 GB more).")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="The target's (and the unquantized draft's) dtype; auto: bfloat16 where native, "
                        "else float32.")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", category=UserWarning)
    dtype = getattr(torch, resolve_dtype(args.dtype))
    target, draft, tokenizer = models.load_default_pair(dtype=dtype, progress=False)
    packed = prepack(target, measure=False).packed
    target_kind = f"{str(dtype).removeprefix('torch.')}, {'prepacked' if packed else 'default kernels'}"
    drafts = build_variants(draft, tokenizer, args.subset_of, args.subset, args.torchao)
    del draft
    release_memory()
    load_before = os.getloadavg()
    times = pass_times({**drafts, "target": target}, args.rounds)
    load_after = os.getloadavg()
    target_ms = times.pop("target")
    profile = {name: profile_one_row(drafts[name]) for name in list(drafts)[:2]}  # dynamic int8, the dense draft

    def save(accept: dict) -> None:  # after the timings, and again with the acceptance counts
        lines = tables(times, target_ms, target_kind, accept or {"-": {"-": "-"}})
        (args.output / "results.json").write_text(json.dumps({
            "environment": collect_environment(), "dtype": str(dtype), "target_kind": target_kind,
            "loadavg_before_after_timing": [load_before, load_after],
            "rounds": args.rounds, "past_length": 256, "rows": ROWS, "draft_ms": times, "target_ms": target_ms,
            "acceptance": accept, "acceptance_settings": {"prompts": f"humaneval:{args.prompts}",
                                                          "max_new_tokens": args.max_new_tokens, "methods": METHODS},
            "profile_one_row_self_cpu_share": profile, "table": lines}, indent=1))
        (args.output / "README.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    save({})
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in humaneval_prompts(args.prompts)]
    base = times["dynamic-int8"]  # acceptance only for today's draft and the variants faster at some pass size
    counted = {name: d for name, d in drafts.items()
               if name == "dynamic-int8" or any(times[name][n] < base[n] for n in ROWS)}
    save(acceptance(target, counted, prompts, args.max_new_tokens))


if __name__ == "__main__":
    main()
