"""Forward time against tree size for the embedded pair in each dtype, and for the int8 draft: the curves every
tree-size decision here rests on, measured on this machine.

    .venv/bin/python benchmarks/latency_curves.py --output benchmarks/latency

Writes `curves.json` (the machine, settings and every median) and `curves.png`. A tree of n tokens pays off only
when a pass over n tokens costs much less than n single-token passes: the plot shows where that holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_specdec import quantize_draft
from hf_specdec.planning.latency import measure_latency
from hf_specdec.tools import models
from hf_specdec.tools.bench.environment import collect_environment

SIZES = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/latency"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--past-length", type=int, default=256, help="Cached tokens before the measured pass.")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    curves = {}
    for dtype in (torch.bfloat16, torch.float32):
        target, draft, _ = models.load_default_pair(dtype=dtype, progress=False)
        name = str(dtype).removeprefix("torch.")
        pairs = [(f"target 1.5B {name}", target), (f"draft 0.5B {name}", draft)]
        if dtype == torch.float32:
            pairs.append(("draft 0.5B int8 (dynamic)", quantize_draft(draft)))
        for label, model in pairs:
            curve = measure_latency(model, SIZES, args.past_length, args.repeats, progress=True, desc=label,
                                    stop_ratio=24.0)
            curves[label] = {"sizes": list(curve.sizes), "ms": [round(s * 1000, 2) for s in curve.seconds]}
            print(label, dict(zip(curves[label]["sizes"], curves[label]["ms"])), flush=True)
        del target, draft
    env = collect_environment()
    (args.output / "curves.json").write_text(json.dumps({"environment": env, "past_length": args.past_length,
                                                        "repeats": args.repeats, "curves": curves}, indent=1))
    plot(curves, env, args.output / "curves.png")


def plot(curves: dict, env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, curve in curves.items():
        ax.plot(curve["sizes"], curve["ms"], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new tokens in one forward pass (tree size)")
    ax.set_ylabel("ms per pass (median)")
    ax.set_title("Forward time against tree size", fontsize=10)
    ax.legend(fontsize=8)
    caption = f"{env['cpu']}, {env['torch_threads']} threads, torch {env['versions']['torch']}"
    fig.text(0.01, 0.01, caption, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
