"""Static cache and compiled target on a CPU: compile time, tree-pass times per size compiled vs eager, whole-call
tokens/s against plain static-cache `generate` compiled the same way (the embedded pair; `--dtype auto`, the
default, is bfloat16 where this CPU multiplies it natively, else float32).

    python -m hf_specdec_tools.bench.studies.static_compile --output benchmarks/results/zen4/static-compile.json

Part 1 times one target pass over a padded tree of each size on a StaticCache after a HumanEval prompt (median of
`--repeats`), eagerly and through `target.get_compiled_call(config)`; the first compiled call's time is the compile.
Part 2 runs whole calls (greedy, `--new-tokens` tokens) eager and compiled, plain first, in one process (a
`-captured` method compiles its whole step, the draft's passes, the verdict and the compaction, as one graph): each
prompt eager then compiled back to back, `--call-repeats` rounds, after one compiling call per method (timed apart); it
reports tokens/s, the median compiled/eager ratio of the pairs, whether their outputs are identical, and the graphs
dynamo compiled during each call. torch.compile on 2 shared cores is slow: each part is
time-boxed by `--sizes` / `--methods`. Every figure is from this process; the machine is written next to them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.accept.kv_cache import crop
from hf_specdec.core.releases import cache_arg
from hf_specdec.core.tree import TokenTree
from hf_specdec.decoding.step import tree_pass
from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.runtime.attention import AttentionLayout
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec.runtime.pass_shapes import PassShapes
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.models import load_default_pair
from hf_specdec_tools.prompts import humaneval_prompts

METHODS = {
    "chain": {"num_draft_tokens": 4, "confidence_threshold": 0},  # a fixed shape: one graph per pass size
    "sequoia": {"plan": plan_tree([0.75, 0.1, 0.05, 0.02], budget=16, max_depth=6)},
    "specexec": {"budget": 16, "max_depth": 8},
    "tree": {},  # the default shape, sized every step
    "staged": {"budget": 16, "max_depth": 8},
    # the same fixed shapes as steps captured whole (decoding/captured.py): compiled, one graph per shape
    "chain-captured": {"num_draft_tokens": 4, "confidence_threshold": 0, "guard": False, "captured": True},
    "sequoia-captured": {"plan": plan_tree([0.75, 0.1, 0.05, 0.02], budget=16, max_depth=6), "guard": False,
                         "captured": True},
}


def compile_config() -> CompileConfig:
    # dynamic=False: one graph per shape, as fixed shapes want; mode "default" (reduce-overhead means CUDA graphs)
    config = CompileConfig(fullgraph=False, dynamic=False, backend="inductor", mode="default")
    config._compile_all_devices = True  # Transformers compiles on a CPU only with this switch
    return config


def chain_tree(size: int, token: int) -> TokenTree:
    return TokenTree.from_parents([token] * size, [-1, *range(size - 1)])


def pass_times(target, ids: torch.Tensor, sizes: list[int], repeats: int, config: CompileConfig) -> dict:
    """ms per tree pass at each padded size, eager and compiled, and each size's compile seconds."""
    layout, past = AttentionLayout.of(target), ids.shape[1] - 1
    cache = StaticCache(config=target.config, max_cache_len=ids.shape[1] + 2 * max(sizes))
    with torch.no_grad():
        target(ids[:, :-1], **cache_arg(cache), use_cache=True)
    compiled = target.get_compiled_call(config)
    out = {}
    for size in sizes:
        row = {}
        for name, forward in (("eager", target), ("compiled", compiled)):
            times = []
            for i in range(repeats + 1):
                shapes = PassShapes(cache.layers[0].max_cache_len)
                start = time.perf_counter()
                with torch.no_grad():
                    tree_pass(target, chain_tree(size, int(ids[0, -1])), past, cache, layout, target.dtype,
                              torch.device("cpu"), shapes=shapes, forward=forward)
                times.append(time.perf_counter() - start)
                crop(cache, past)
                if i == 0 and name == "compiled":
                    row["compile_s"] = times[0]
            row[f"{name}_ms"] = 1e3 * statistics.median(times[1:])
        out[size] = row
        print(f"size {size:4d}: {row}", flush=True)
    return out


def _call(target, ids: torch.Tensor, new_tokens: int, spec: dict, extra: dict) -> dict:
    graphs = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                          return_dict_in_generate=True, **spec, **extra)
    seconds = time.perf_counter() - start
    stats = getattr(out, "speculation_stats", None)
    return {"seconds": seconds, "tokens_per_s": (out.sequences.shape[1] - ids.shape[1]) / seconds,
            "graphs": counters["stats"]["unique_graphs"] - graphs, "sequence": out.sequences[0].tolist(),
            "tree_pass_sizes": sorted(stats.tree_pass_sizes) if stats else None,
            "target_forwards": stats.target_forwards if stats else None,
            "target_forward_s": stats.time_target_forward if stats else None,
            "draft_pass_sizes": sorted(stats.draft_pass_sizes) if stats else None,
            "sizes_kept_eager": sorted(stats.sizes_kept_eager) if stats else None,
            "draft_sizes_kept_eager": sorted(stats.draft_sizes_kept_eager) if stats else None,
            "draft_forward_s": stats.time_draft_forward if stats else None}


def whole_calls(target, draft, prompts: list[torch.Tensor], new_tokens: int, methods: list[str],
                config: CompileConfig, repeats: int) -> dict:
    """Per method: one compiled call that compiles (counted apart) and one eager warm-up call, then `repeats`
    rounds over the prompts, each prompt decoded eager then compiled back to back, so that both see the same
    machine; the ratio is the median of the per-pair ratios."""
    results = {}
    for name in ["plain", *methods]:
        spec = {} if name == "plain" else {"assistant_model": draft, "speculation": name.removesuffix("-captured"),
                                           "speculation_config": METHODS[name]}
        modes = {"eager": {"disable_compile": True}, "compiled": {"compile_config": config}}
        first = {mode: _call(target, prompts[0], new_tokens, spec, extra) for mode, extra in modes.items()}
        runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
        for _ in range(repeats):
            for ids in prompts:
                for mode, extra in modes.items():
                    runs[mode].append(_call(target, ids, new_tokens, spec, extra))
        pairs = [c["tokens_per_s"] / e["tokens_per_s"] for e, c in zip(runs["eager"], runs["compiled"])]
        same = all(e["sequence"] == c["sequence"] for e, c in zip(runs["eager"], runs["compiled"]))
        results[name] = {
            "eager_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["eager"]),
            "compiled_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["compiled"]),
            "compiled_over_eager": statistics.median(pairs), "pair_ratios": pairs, "outputs_identical": same,
            "first_compiled_call_s": first["compiled"]["seconds"], "graphs_first_call": first["compiled"]["graphs"],
            "graphs_later_calls": sum(r["graphs"] for r in runs["compiled"]), "first_calls": first, "runs": runs}
        row = results[name]
        print(f"{name:10s} eager {row['eager_tokens_per_s']:5.2f} compiled {row['compiled_tokens_per_s']:5.2f} "
              f"tokens/s, compiled/eager {row['compiled_over_eager']:.3f} (pairs {[round(x, 2) for x in pairs]}), "
              f"first compiled call {row['first_compiled_call_s']:.1f} s, graphs {row['graphs_first_call']} then "
              f"{row['graphs_later_calls']}, identical {same}, kept eager {first['compiled']['sizes_kept_eager']}, "
              f"draft sizes {first['compiled']['draft_pass_sizes']}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/static-compile/results.json"))
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", nargs="*", default=["chain", "sequoia"], choices=sorted(METHODS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip-passes", action="store_true")
    parser.add_argument("--call-repeats", type=int, default=2, help="rounds of eager/compiled call pairs per prompt")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    target, draft, tokenizer = load_default_pair(getattr(torch, dtype))
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in humaneval_prompts(args.prompts)]
    config = compile_config()
    report = {"machine": {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "transformers": __import__("transformers").__version__},
              "dtype": dtype,
              "models": "Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft (both on static caches, compiled alike)",
              "compile_config": config.to_dict(), "new_tokens": args.new_tokens, "methods": METHODS}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if not args.skip_passes:
        start = time.perf_counter()
        report["pass_times"] = pass_times(target, prompts[0], args.sizes, args.repeats, config)
        report["pass_times_seconds"] = time.perf_counter() - start
        args.output.write_text(json.dumps(report, indent=1, default=str))
    torch._dynamo.reset()
    report["whole_calls"] = whole_calls(target, draft, prompts, args.new_tokens, args.methods, config,
                                        args.call_repeats)
    args.output.write_text(json.dumps(report, indent=1, default=str))
    print(f"machine: {report['machine']['cpu']}")


if __name__ == "__main__":
    main()
