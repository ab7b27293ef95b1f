"""How unevenly a batch's rows accept (issue 25): for every speculative call stored by `batches.py`, the slowest row's
tokens per speculative step over the rows' mean (`hf_specdec.plan.call_pricing.slowest_row_share`), the medians
by batch size. `call_pricing.SLOWEST_ROW_SHARE`, the prior a batch call is priced with before one of its size has
measured it, is this median over the Zen 3 runs.

    .venv/bin/python -m hf_specdec_tools.bench.studies.slowest_row_share benchmarks/results/zen3/batches/*.json

(The prior was taken over every Zen 3 run then stored: commit eaea7f0, benchmarks/batches-zen3/*/results.json.)

A row's tokens per speculative step: its new tokens over its target steps, the plain ones (one token each) taken off
both. Runs written before `batches.py` stored `row_rates` are read from their sequences (new tokens up to the
first eos) and per-row step counts. Calls where the guard ran more than 3 plain steps a row on average are left
out: their rows' rates are mostly the guard's choice, not acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from transformers import GenerationConfig

from hf_specdec.plan.call_pricing import slowest_row_share
from hf_specdec_tools.models import DEFAULT_TARGET, model_dir

MAX_PLAIN_PER_ROW = 3


def row_rates(run: dict, new_tokens: int, eos: set[int]) -> list[float] | None:
    """The run's stored rates, else derived from its sequences and step counts (None where it has no step counts,
    or the guard ran it mostly plain)."""
    steps, plain = run.get("target_forwards"), run.get("plain_steps") or [0] * len(run.get("target_forwards") or [])
    if not steps or sum(plain) > MAX_PLAIN_PER_ROW * len(plain):
        return None
    if "row_rates" in run:
        return run["row_rates"]
    tokens = [next((i + 1 for i, token in enumerate(row[-new_tokens:]) if token in eos), new_tokens)
              for row in run["sequences"]]
    return [(n - p) / (s - p) if s > p else 0.0 for n, s, p in zip(tokens, steps, plain)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files written by the `batches` study")
    args = parser.parse_args()
    eos = GenerationConfig.from_pretrained(model_dir(DEFAULT_TARGET)).eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    shares = defaultdict(list)
    for path in args.results:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            for run in row["runs"]["speculative"]:
                rates = row_rates(run, data["settings"]["new_tokens"], eos)
                share = slowest_row_share(rates) if rates else None
                if share is not None:
                    shares[row["batch"]].append(share)
    every = [share for values in shares.values() for share in values]
    for batch, values in sorted(shares.items()):
        print(f"B = {batch}: {len(values)} calls, slowest row / mean {statistics.median(values):.3f} "
              f"(range {min(values):.2f}-{max(values):.2f})")
    print(f"all: {len(every)} calls, median {statistics.median(every):.3f}")


if __name__ == "__main__":
    main()
