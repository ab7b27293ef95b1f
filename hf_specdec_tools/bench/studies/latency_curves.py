"""Forward time against tree size for the embedded pair in each dtype, with PyTorch's default kernels and with the
Linear weights prepacked (`hf_specdec.prepack`), and for the int8 draft: the curves every tree-size decision here
rests on, measured on this machine.

    .venv/bin/python -m hf_specdec_tools.bench.studies.latency_curves --output benchmarks/latency
    .venv/bin/python -m hf_specdec_tools.bench.studies.latency_curves --quantized --output benchmarks/latency-quantized

Writes `curves.json` (the machine, settings and every median), `curves.png` (ms per pass) and `ratio.png` (pass(n) /
pass(1): a tree of n tokens pays off only when a pass over n tokens costs much less than n single-token passes).
With `--quantized`, the bfloat16 target prepacked against the same target through every quantization route of
`hf-specdec bench --quantize-target`, and through PyTorch's dynamic int8 (`quantize_draft`, not offered for targets).
With `--hints 1,4,16`, the target in `--dtype` unpacked and prepacked for each number of rows per pass (`prepack`'s
`rows_hint`: the pass size oneDNN blocks the weights for), measured in rounds that alternate the order.

    python -m hf_specdec_tools.bench.studies.latency_curves --hints 1,4,16 --dtype float32 \
        --output benchmarks/prepack-hints
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from hf_specdec import prepack, quantize_draft
from hf_specdec.plan.latency import measure_latency
from hf_specdec_tools import models
from hf_specdec_tools.bench.environment import collect_environment

SIZES = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/latency"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--past-length", type=int, default=256, help="Cached tokens before the measured pass.")
    parser.add_argument("--quantized", action="store_true", help="The target under each quantization route.")
    parser.add_argument("--hints", help="Comma-separated rows_hint values: the target prepacked for each.")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="The target's dtype, for --hints.")
    parser.add_argument("--rounds", type=int, default=2, help="Rounds of every --hints variant, order alternating.")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.hints:
        curves = hint_curves(args)
    else:
        curves = quantized_curves(args) if args.quantized else dtype_curves(args)
    env = collect_environment()
    (args.output / "curves.json").write_text(json.dumps({"environment": env, "past_length": args.past_length,
                                                        "repeats": args.repeats, "curves": curves}, indent=1))
    replot(args.output)


def dtype_curves(args) -> dict:
    curves: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        target, draft, _ = models.load_default_pair(dtype=dtype, progress=False)
        name = str(dtype).removeprefix("torch.")
        pairs = [(f"target 1.5B {name}", target), (f"draft 0.5B {name}", draft)]
        if dtype == torch.float32:
            pairs.append(("draft 0.5B int8 (dynamic)", quantize_draft(draft, scheme="dynamic-int8")))
        for label, model in pairs:
            measure(curves, label, model, args)
        for label, model in pairs[:2]:
            if prepack(model, measure=False).packed:  # oneDNN packs bfloat16 only on CPUs with AVX-512 or AVX-NE
                measure(curves, f"{label} prepacked", model, args)
        del target, draft, pairs
    return curves


def hint_curves(args) -> dict:
    """The target unpacked and prepacked for each rows hint, round by round (each label gets one curve a round)."""
    from transformers import AutoModelForCausalLM

    from hf_specdec.kernels.prepack import unpack

    hints = [int(h) for h in args.hints.split(",")]
    target = AutoModelForCausalLM.from_pretrained(models.fetch(models.DEFAULT_TARGET),
                                                  dtype=getattr(torch, args.dtype)).eval()
    rounds: dict[str, list] = {}
    for index in range(args.rounds):
        for hint in ([0, *hints] if index % 2 == 0 else [*reversed(hints), 0]):
            label = f"target 1.5B {args.dtype} " + (f"prepacked for {hint} rows" if hint else "unpacked")
            if hint and not prepack(target, measure=False, rows_hint=hint).packed:
                raise SystemExit(f"The {args.dtype} target cannot be prepacked on this CPU.")
            one: dict = {}
            measure(one, label, target, args)
            rounds.setdefault(label, []).append(one[label])
            unpack(target)
    return {label: {"sizes": curves[0]["sizes"], "rounds": curves,
                    "ms": [round(statistics.median(ms), 2) for ms in zip(*(c["ms"] for c in curves))]}
            for label, curves in rounds.items()}


def quantized_curves(args) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_specdec_tools.bench.target_quantization import ROUTES, available_routes, quantization_config

    curves: dict = {}
    folder = models.fetch(models.DEFAULT_TARGET)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    prepack(target, measure=False)
    measure(curves, "target 1.5B bfloat16 prepacked", target, args)
    del target
    for route in available_routes():
        target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                      quantization_config=quantization_config(route)).eval()
        measure(curves, f"{route}: {ROUTES[route].description}", target, args)
        del target
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    measure(curves, "PyTorch dynamic int8 (quantize_draft; not lossless for a target)",
            quantize_draft(target, scheme="dynamic-int8"), args)
    return curves


def replot(folder: Path) -> None:
    data = json.loads((folder / "curves.json").read_text())
    plot(data["curves"], data["environment"], folder / "curves.png")
    plot(data["curves"], data["environment"], folder / "ratio.png", ratio=True)


def measure(curves: dict, label: str, model, args) -> None:
    curve = measure_latency(model, SIZES, args.past_length, args.repeats, progress=True, desc=label, stop_ratio=24.0)
    curves[label] = {"sizes": list(curve.sizes), "ms": [round(s * 1000, 2) for s in curve.seconds]}
    print(label, dict(zip(curves[label]["sizes"], curves[label]["ms"])), flush=True)


def plot(curves: dict, env: dict, path: Path, ratio: bool = False, caption: str | None = None) -> None:
    """Curves {label: {"sizes", "ms"}} on log-log axes; the caption names the machine (`env`, or `caption`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {}
    for label, curve in curves.items():
        values = [ms / curve["ms"][0] for ms in curve["ms"]] if ratio else curve["ms"]
        color = colors.setdefault(label.removesuffix(" prepacked"), f"C{len(colors)}")  # one colour per model
        ax.plot(curve["sizes"], values, marker="o", label=label, color=color,
                linestyle="--" if label.endswith("prepacked") else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new tokens in one forward pass (tree size)")
    ax.set_ylabel("pass(n) / pass(1)" if ratio else "ms per pass (median)")
    ax.set_title("Forward time against tree size, relative to one token" if ratio else
                 "Forward time against tree size", fontsize=10)
    ax.legend(fontsize=8)
    if caption is None:
        flags = ", ".join(env.get("cpu_flags") or [])
        caption = f"{env['cpu']} ({flags}), {env['torch_threads']} threads, torch {env['versions']['torch']}"
    fig.text(0.01, 0.01, caption, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
