"""The draft's int8 matrix products on a CPU, kernel by kernel: ms per Linear layer of the embedded draft's shapes
over 1-32 rows, and the pass those layers add up to.

    .venv/bin/python -m hf_specdec_tools.bench.studies.int8_kernels --output benchmarks/results/zen3/int8-kernels

Why: `quantize_draft`'s "dynamic-int8" scheme is built on `torch.ao.quantization.quantize_dynamic` (fbgemm), an API
PyTorch has deprecated in favour of torchao. torchao's own int8 configurations were measured eager
(docs/cpu-kernels-and-quantization.md: 7-10x slower per pass); torchao is made to run under `torch.compile`, so this
measures them compiled, against fbgemm, on the same random weights of the draft's shapes (several copies of a layer
cycled so that each call reads its weight from memory, as a pass over 24 layers does):

- `fbgemm-dynamic`: `quantize_dynamic`'s Linear (int8 weights, activations quantized per call with one scale),
  what `quantize_draft` builds today;
- `torchao-dynamic`: torchao's `Int8DynamicActivationInt8WeightConfig` (activations quantized per row), compiled;
- `torchao-weight-only`: torchao's `Int8WeightOnlyConfig` (float32 activations), compiled.

Compiled with inductor's `freezing` and `max_autotune` (GEMM backends CPP and ATEN), one graph over every copy of a
layer per row count, as `linear_kernels.py` compiles the target's. Every cell times its variants in interleaved
rounds (median of `--repeats` calls each, median over rounds). Writes results.json and README.md.
"""

from __future__ import annotations

import copy
import gc
import statistics
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig

from hf_specdec_tools.models.fetch import DEFAULT_DRAFT, fetch  # noqa: E402

from .linear_kernels import (  # noqa: E402
    compiled,
    kernel_tables,
    run_kernels,
    target_shapes,
    timed,
    timing_arguments,
)

VARIANTS = ("fbgemm-dynamic", "torchao-dynamic", "torchao-weight-only")
COPIES_BYTES = 128 * 2**20  # a cell's int8 copies of its weight together at least this large (past the caches)


class Stack(torch.nn.Module):
    """Copies of one layer, applied one after another to the same input."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers]


def torchao_stack(stack: Stack, config, x: torch.Tensor):
    """`stack` quantized by torchao's `config` and compiled as `linear_kernels.compiled` compiles (frozen weights,
    inductor's GEMM templates); (callable, compile seconds)."""
    from torchao.quantization import quantize_

    quantized = copy.deepcopy(stack)
    quantize_(quantized, config)
    return compiled(quantized, x)


def measure_cell(out_features: int, in_features: int, rows: int, args) -> dict:
    """ms per layer of each variant over `rows` rows, compile seconds, and each variant's largest difference to the
    float32 layer (relative to the output's largest magnitude)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    copies = max(1, min(args.max_copies, COPIES_BYTES // (out_features * in_features)))
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(copies):
        layer = torch.nn.Linear(in_features, out_features, bias=False)
        layer.weight.data = torch.randn(out_features, in_features, generator=generator) * 0.02
        layers.append(layer)
    stack = Stack(layers).eval()
    x = torch.randn(rows, in_features, generator=generator)
    with warnings.catch_warnings():  # the deprecation this benchmark is about
        warnings.simplefilter("ignore")
        fbgemm = torch.ao.quantization.quantize_dynamic(copy.deepcopy(stack), {torch.nn.Linear}, dtype=torch.qint8)
    calls, compile_seconds = {"fbgemm-dynamic": fbgemm}, {}
    for name, config in (("torchao-dynamic", Int8DynamicActivationInt8WeightConfig()),
                         ("torchao-weight-only", Int8WeightOnlyConfig())):
        calls[name], compile_seconds[name] = torchao_stack(stack, config, x)
    with torch.no_grad():
        reference = stack(x)[0]
        scale = reference.abs().max().item()
        error = {name: (call(x)[0] - reference).abs().max().item() / scale for name, call in calls.items()}
    rounds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            rounds[name].append(timed(call, x, args.repeats) / copies * 1e3)
    del calls
    torch._dynamo.reset()
    gc.collect()
    return {"ms": {name: statistics.median(values) for name, values in rounds.items()}, "rounds": rounds,
            "copies": copies, "compile_seconds": compile_seconds, "relative_error": error}


def write_readme(path: Path, results: dict) -> None:
    machine = results["machine"]
    lines = [f"# The draft's int8 Linear layers, kernel by kernel ({machine['cpu']}, {', '.join(machine['flags'])})",
             "", f"torch {machine['torch']}, torchao {results['torchao']}, {machine['threads']} threads; the shapes of "
             f"{results['model']}. ms per layer call (at most {results['settings']['max_copies']} copies of a layer "
             f"cycled), median over rounds of the median of {results['settings']['repeats']} calls; interleaved per "
             "cell.", ""]
    lines += kernel_tables(results, list(VARIANTS), cell_digits=3, pass_digits=1)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = timing_arguments(__doc__.split("\n\n")[0], "1,4,16,32")
    parser.add_argument("--max-copies", type=int, default=16,
                        help="at most this many copies of a layer per cell (each compiled copy is autotuned apart)")
    args = parser.parse_args()
    try:
        import torchao
    except ImportError:
        parser.error("this benchmark compares against torchao: pip install torchao")
    shapes = target_shapes(AutoConfig.from_pretrained(fetch(DEFAULT_DRAFT, progress=False)))
    run_kernels(args, shapes, list(VARIANTS), measure_cell, DEFAULT_DRAFT.title, {"max_copies": args.max_copies},
                write_readme, torchao=torchao.__version__)


if __name__ == "__main__":
    main()
