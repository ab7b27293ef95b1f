"""The target's matrix products on a CPU, kernel by kernel: ms per Linear layer of the embedded target's shapes over
1-32 rows, and the pass those layers add up to.

    .venv/bin/python -m hf_specdec_tools.bench.studies.linear_kernels --output benchmarks/results/zen3/linear-kernels

Why: a tree pass is a matrix product with a few rows, and what it costs against a one-row pass decides which trees
pay (docs/cpu-kernels-and-quantization.md, "What this hardware rewards"). `hf_specdec.prepack` serves it with
oneDNN's packed weights; this measures the kernels a float32 target could use instead, each on the same random
weights of the target's shapes (query/output, key/value, gate/up, down, the output layer; several copies of a
layer's weight cycled so that each call reads its weight from memory, as a pass over 28 layers does):

- `aten`: `F.linear` on the plain weight (MKL for float32), what an unprepacked model runs;
- `onednn-16`, `onednn-1`: oneDNN's weight packed for 16-row passes (`prepack`'s default) and for one row;
- `inductor-cpp-gemm`: `torch.compile` with inductor's `freezing` and `max_autotune` (GEMM backends CPP and ATEN), one
  graph per row count: inductor packs the frozen weight and generates a micro-kernel for the shape. The weight must be
  a frozen constant of the graph (without `freezing` inductor falls back to aten), so every compiled graph holds its
  own packed copy of the weights it reads.

Every cell (shape, rows) times its variants in interleaved rounds (median of `--repeats` calls each, median over
rounds). The pass estimate is the target's layers times each shape's count per layer plus the output layer over the
same rows (attention, norms and the embedding left out). Writes results.json (machine, settings, every figure) and
README.md (the tables).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.models.fetch import DEFAULT_TARGET, fetch

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
EAGER = ("aten", "onednn-16", "onednn-1")
COPIES_BYTES = 256 * 2**20  # a cell's copies of its weight together at least this large (past the caches)


def target_shapes(config) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, layers per pass) of the target's Linear layers."""
    text = config.get_text_config()
    hidden, inner = text.hidden_size, text.intermediate_size
    kv = text.num_key_value_heads * (getattr(text, "head_dim", None) or hidden // text.num_attention_heads)
    layers = text.num_hidden_layers
    return [("query/output", hidden, hidden, 2 * layers), ("key/value", kv, hidden, 2 * layers),
            ("gate/up", inner, hidden, 2 * layers), ("down", hidden, inner, layers),
            ("output layer", text.vocab_size, hidden, 1)]


class Stack(torch.nn.Module):
    """The copies of one layer's weight, applied one after another to the same input (one call per copy)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(x, w) for w in self.weights]


def compiled(stack: torch.nn.Module, x: torch.Tensor):
    """`stack` compiled with frozen weights and inductor's CPP GEMM template; (callable, compile seconds)."""
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    with inductor.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
        call = torch.compile(stack, dynamic=False)
        start = time.perf_counter()
        with torch.no_grad():
            call(x)
        return call, time.perf_counter() - start


def timed(call, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    with torch.no_grad():
        call(x)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            call(x)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure_cell(out_features: int, in_features: int, rows: int, args) -> dict:
    """ms per layer of each variant over `rows` rows, and the compile's seconds."""
    copies = max(1, min(8, COPIES_BYTES // (out_features * in_features * 4)))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=generator) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, in_features, generator=generator)
    packed16 = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    packed1 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    calls = {
        "aten": lambda x: [F.linear(x, w) for w in weights],
        "onednn-16": lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed16],
        "onednn-1": lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed1],
    }
    stack = Stack(weights).eval()
    reference = calls["aten"](x)[0]
    calls["inductor-cpp-gemm"], compile_seconds = compiled(stack, x)
    with torch.no_grad():
        difference = (calls["inductor-cpp-gemm"](x)[0] - reference).abs().max().item()
    rounds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            rounds[name].append(timed(call, x, args.repeats) / copies * 1e3)
    del calls, stack
    torch._dynamo.reset()
    gc.collect()
    return {"ms": {name: statistics.median(values) for name, values in rounds.items()}, "rounds": rounds,
            "copies": copies, "compile_seconds": compile_seconds, "max_abs_difference_to_aten": difference}


def kernel_tables(results: dict, variants: list[str], cell_digits: int = 2, pass_digits: int = 0) -> list[str]:
    """README lines: a table per shape (ms per layer call by rows) and the pass they add up to."""
    sizes, lines = results["settings"]["rows"], []
    for name, *_ in results["shapes"]:
        lines += [f"## {name}", "", "| rows | " + " | ".join(variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for rows in sizes:
            cell = results["cells"][f"{name}/{rows}"]
            lines.append(f"| {rows} | " + " | ".join(f"{cell['ms'][v]:.{cell_digits}f}" for v in variants) + " |")
        lines.append("")
    lines += ["## The pass they add up to (ms; attention, norms and the embedding left out)", "",
              "| rows | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for rows in sizes:
        lines.append(f"| {rows} | " + " | ".join(f"{results['pass_ms'][v][str(rows)]:.{pass_digits}f}"
                                                  for v in variants) + " |")
    return lines


def write_readme(path: Path, results: dict) -> None:
    machine = results["machine"]
    lines = [f"# The target's Linear layers, kernel by kernel ({machine['cpu']}, {', '.join(machine['flags'])})", "",
             f"torch {machine['torch']}, {machine['threads']} threads; float32; the shapes of {results['model']}. "
             "ms per layer call, median over rounds of the median of "
             f"{results['settings']['repeats']} calls; interleaved per cell.", ""]
    lines += kernel_tables(results, list(EAGER) + ["inductor-cpp-gemm"])
    path.write_text("\n".join(lines) + "\n")


def timing_arguments(description: str, rows: str) -> argparse.ArgumentParser:
    """The options both kernel benchmarks take: rows per call, repeats, rounds, output folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", default=rows, help="rows per call (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per variant in a round (median)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per cell (median)")
    parser.add_argument("--output", type=Path, required=True)
    return parser


def run_kernels(args, shapes: list, variants: list[str], measure, model: str, settings: dict, write,
                **extra) -> None:
    """Every (shape, rows) cell timed by `measure(out, in, rows, args)`, the passes they add up to, and the results
    saved under `args.output` (results.json; README.md by `write(path, results)`)."""
    sizes = [int(rows) for rows in args.rows.split(",")]
    cells = {}
    for name, out_features, in_features, _ in shapes:
        for rows in sizes:
            cells[f"{name}/{rows}"] = cell = measure(out_features, in_features, rows, args)
            print(name, rows, {v: round(ms, 3) for v, ms in cell["ms"].items()}, flush=True)
    pass_ms = {v: {str(rows): sum(count * cells[f"{name}/{rows}"]["ms"][v] for name, _, _, count in shapes)
                   for rows in sizes} for v in variants}
    results = {
        "model": model, **extra,
        "machine": {"cpu": cpu_model(), "flags": [f for f in FLAGS if f in cpu_flags()],
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "settings": {"rows": sizes, "repeats": args.repeats, "rounds": args.rounds, **settings},
        "shapes": shapes, "cells": cells, "pass_ms": pass_ms,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps(results, indent=1))
    write(args.output / "README.md", results)
    print((args.output / "README.md").read_text())


def main() -> None:
    args = timing_arguments(__doc__.split("\n\n")[0], "1,2,4,8,16,32").parse_args()
    shapes = target_shapes(AutoConfig.from_pretrained(fetch(DEFAULT_TARGET, progress=False)))
    run_kernels(args, shapes, list(EAGER) + ["inductor-cpp-gemm"], measure_cell, DEFAULT_TARGET.title,
                {"dtype": "float32"}, write_readme)


if __name__ == "__main__":
    main()
