"""Could the draft run beside the target? The CPU's cores split between the two models' passes, measured.

    .venv/bin/python -m hf_specdec_tools.bench.studies.parallel_passes --output benchmarks/results/zen3/parallel-passes

Why: on a CPU every engine here runs the draft's passes and the target's one after another, each on every core. A
parallel scheme (PEARL, arXiv 2408.11850: the draft proposes the next step's tokens while the target verifies) hides
the drafting only if the target, given fewer cores, loses less time than the draft's passes cost. A one-token pass is
bound by memory bandwidth rather than by arithmetic, so it might lose little. This measures, on the embedded pair
(float32 target prepacked, `quantize_draft`'s draft, after 256 cached tokens):

- each model's pass on all cores and on its share (the target over 1-16 tokens, the draft over one);
- both at once: the target's passes on its share of the cores while a second Python thread runs the draft's
  one-token passes on the rest, back to back (PyTorch releases the interpreter lock inside its kernels; each
  thread sets its own thread count);
- what a step costs both ways for k draft passes: in turn, target(all) + k x draft(all); side by side, the longer
  of the target's pass and k concurrent draft passes.

Writes results.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_specdec
from hf_specdec.core.releases import cache_arg
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.models import load_default_pair

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
CACHED = 256


class Passes:
    """One model's passes over `n` new tokens after the same `CACHED` tokens (the cache cropped back each time)."""

    def __init__(self, model, generator: torch.Generator) -> None:
        self.model, self.cache = model, DynamicCache(config=model.config)
        self.vocab = model.config.vocab_size
        with torch.no_grad():
            model(torch.randint(100, self.vocab, (1, CACHED), generator=generator), **cache_arg(self).cache)
        self.generator = generator

    def run(self, n: int) -> float:
        ids = torch.randint(100, self.vocab, (1, n), generator=self.generator)
        with torch.no_grad():
            start = time.perf_counter()
            self.model(ids, **cache_arg(self).cache, logits_to_keep=n)
            seconds = time.perf_counter() - start
        self.cache.crop(-n)
        return seconds

    def median(self, n: int, repeats: int) -> float:
        self.run(n)
        return statistics.median(self.run(n) for _ in range(repeats))


def side_by_side(target: Passes, draft: Passes, n: int, repeats: int, target_threads: int,
                 draft_threads: int) -> tuple[float, float, int]:
    """Median target seconds over `n` tokens on `target_threads` while another thread runs one-token draft passes on
    `draft_threads`; the draft's median pass and how many it ran."""
    stop, drafted = threading.Event(), []

    def drafting() -> None:
        torch.set_num_threads(draft_threads)
        while not stop.is_set():
            drafted.append(draft.run(1))

    torch.set_num_threads(target_threads)
    worker = threading.Thread(target=drafting)
    worker.start()
    try:
        time.sleep(0.2)  # the draft's loop under way
        seconds = [target.run(n) for _ in range(repeats + 1)][1:]
    finally:
        stop.set()
        worker.join()
    return statistics.median(seconds), statistics.median(drafted), len(drafted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,8,16", help="target pass sizes (tokens, comma-separated)")
    parser.add_argument("--draft-threads", type=int, default=1, help="the draft's share of the threads")
    parser.add_argument("--draft-passes", default="2,4,6", help="draft passes per step to price (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    sizes, ks = [int(s) for s in args.sizes.split(",")], [int(k) for k in args.draft_passes.split(",")]
    cores = torch.get_num_threads()
    if not 0 < args.draft_threads < cores:
        parser.error(f"--draft-threads must leave the target at least one of the {cores} threads")
    mine = cores - args.draft_threads
    target, draft, _ = load_default_pair(torch.float32, progress=False)
    hf_specdec.prepack(target)
    draft = hf_specdec.quantize_draft(draft)
    generator = torch.Generator().manual_seed(0)
    targets, drafts = Passes(target, generator), Passes(draft, generator)
    draft_all = drafts.median(1, args.repeats)
    torch.set_num_threads(args.draft_threads)
    draft_share = drafts.median(1, args.repeats)
    rows = []
    for n in sizes:
        torch.set_num_threads(cores)
        target_all = targets.median(n, args.repeats)
        torch.set_num_threads(mine)
        target_share = targets.median(n, args.repeats)
        together, draft_together, count = side_by_side(targets, drafts, n, args.repeats, mine, args.draft_threads)
        torch.set_num_threads(cores)
        steps = {k: {"in_turn": target_all + k * draft_all, "side_by_side": max(together, k * draft_together)}
                 for k in ks}
        rows.append({"tokens": n, "target_all": target_all, "target_share": target_share,
                     "target_beside_draft": together, "draft_beside_target": draft_together,
                     "draft_passes_beside": count, "step": steps})
        print(rows[-1], flush=True)
    machine = {"cpu": cpu_model(), "flags": [f for f in FLAGS if f in cpu_flags()], "threads": cores,
               "torch": torch.__version__}
    results = {"machine": machine, "settings": {"draft_threads": args.draft_threads, "target_threads": mine,
                                                "repeats": args.repeats, "cached": CACHED},
               "draft_all": draft_all, "draft_share": draft_share, "rows": rows}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"{machine['cpu']} ({', '.join(machine['flags'])}), {cores} threads, torch {machine['torch']}; float32 "
             f"target prepacked, int8 draft, after {CACHED} cached tokens; medians of {args.repeats}. Draft's "
             f"one-token pass: {draft_all * 1e3:.0f} ms on {cores} threads, {draft_share * 1e3:.0f} on "
             f"{args.draft_threads}.", "",
             f"| target tokens | target ms, {cores} threads | {mine} | {mine} beside the draft | draft ms beside it | "
             + " | ".join(f"step with {k} draft passes: in turn / side by side" for k in ks) + " |",
             "|---|---|---|---|---|" + "---|" * len(ks)]
    for row in rows:
        lines.append(f"| {row['tokens']} | {row['target_all'] * 1e3:.0f} | {row['target_share'] * 1e3:.0f} | "
                     f"{row['target_beside_draft'] * 1e3:.0f} | {row['draft_beside_target'] * 1e3:.0f} | "
                     + " | ".join(f"{row['step'][k]['in_turn'] * 1e3:.0f} / {row['step'][k]['side_by_side'] * 1e3:.0f}"
                                  for k in ks) + " |")
    (args.output / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
