"""One sampled verification (Sequoia's recursive rejection sampling, `SequoiaVerifier`) on the CPU, in the walk's two
read modes: a read after each level, stopping where the walk ends (the CPU's default), and every level on the device
with one read (`stop_early=False`, what a GPU runs).

    python -m hf_specdec_tools.bench.studies.sampled_verify --output benchmarks/results/xeon-amx/sampled-verify.json

Qwen's 151,936-token vocabulary, random target rows and a draft near them (the draft's rows its logits at T 0.7 and
top-k 50, children drawn from them without replacement), the target processed at T 0.7, top-k 50, top-p 0.9 as plain
`generate` would; a chain of 4 and a tree of 3 x 2; draft rows dense or as their top-50 columns (`draft_columns`, as
the drafters hand them). Medians over `--trees` trees x `--rounds` rounds, modes alternating; the mean accepted length
of each mode (the same distribution: the modes differ in when they read, not in what they draw).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_specdec.core.tree import TokenTree
from hf_specdec.logits.processing import NodeScores
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec.verify import SequoiaVerifier

VOCABULARY = 151_936
SHAPES = {"chain4": [-1, 0, 1, 2, 3], "tree3x2": [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]}
TARGET = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)])
DRAFT = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(50)])


class OneRead(SequoiaVerifier):
    stop_early = False


def drafted(parents: list[int], seed: int, columns: bool) -> tuple[TokenTree, torch.Tensor]:
    """A tree of the given shape drawn from a draft near the target, and the target's raw logits at its nodes."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(len(parents), VOCABULARY, generator=generator) * 4
    draft = target + torch.randn(len(parents), VOCABULARY, generator=generator) * 0.7
    q = DRAFT(torch.zeros(len(parents), 1, dtype=torch.long), draft).softmax(-1)
    tokens, drawn = [1], {}
    for node in range(1, len(parents)):
        row = q[parents[node]].clone()
        row[[tokens[sibling] for sibling in drawn.get(parents[node], [])]] = 0  # without replacement
        tokens.append(int(torch.multinomial(row / row.sum(), 1, generator=generator)))
        drawn.setdefault(parents[node], []).append(node)
    tree = TokenTree.from_parents(tokens, parents, draft_probs=q,
                                  draft_columns=q.topk(50, -1).indices if columns else None)
    return tree, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--trees", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = {"read per level (CPU default)": SequoiaVerifier(), "one read (off the CPU)": OneRead()}
    rows = []
    for shape, parents in SHAPES.items():
        for columns in (False, True):
            trees = [drafted(parents, seed, columns) for seed in range(args.trees)]
            seconds = {mode: [] for mode in modes}
            accepted = {mode: [] for mode in modes}
            generator = torch.Generator().manual_seed(0)
            for _ in range(args.rounds):
                for tree, logits in trees:
                    for mode, verifier in modes.items():
                        scores = NodeScores(TARGET, torch.zeros(1, 3, dtype=torch.long), tree, logits)
                        start = time.perf_counter()
                        verdict = verifier.verify(tree, scores, generator)
                        seconds[mode].append(time.perf_counter() - start)
                        accepted[mode].append(len(verdict.path) - 1)
            for mode in modes:
                row = {"shape": shape, "draft_columns": columns, "mode": mode,
                       "median_ms": 1000 * statistics.median(seconds[mode]),
                       "mean_accepted": statistics.mean(accepted[mode]), "verifications": len(seconds[mode])}
                rows.append(row)
                print(f"{shape:8s} columns={columns!s:5s} {mode:30s} {row['median_ms']:7.2f} ms  "
                      f"accepted {row['mean_accepted']:.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": {"cpu": cpu_model(), "flags": cpu_flags(),
                                                   "torch": torch.__version__, "threads": args.threads},
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
