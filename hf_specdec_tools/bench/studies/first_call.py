"""The first call on a machine with no stored plan: what `sequoia` and `specexec` at their defaults pay before they
decode, and the same call again (which reuses what the first stored).

    .venv/bin/python -m hf_specdec_tools.bench.studies.first_call --output benchmarks/results/zen4/first-call.json

Plans are stored in an empty temporary folder for the run, so the shipped plan (made on the reference machine) is
re-sized here with latency curves measured during the call, as on a user's first call. bf16 prepacked target and
int8 draft (the bench's automatic choices), one HumanEval prompt, greedy, 32 new tokens. Reports each call's wall
time and `speculation_stats.time_plan` (seconds spent on the plan before decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.methods.sequoia import store
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.bench.loading import load_models
from hf_specdec_tools.prompts import humaneval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=Path("bench-results/first-call.json"))
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp())
    store.user_plan_dir = lambda: folder  # no stored plan: the first call re-sizes the shipped one here
    models = load_models(dtype=torch.bfloat16, int8_draft=True, prepack=True, progress=False)
    ids = models.tokenizer(humaneval_prompts(1)[0], return_tensors="pt").input_ids
    rows: dict = {"machine": {"cpu": cpu_model(), "flags": sorted(cpu_flags()), "torch": torch.__version__,
                              "threads": torch.get_num_threads()},
                  "settings": {"dtype": "bfloat16", "prepacked_target": True, "int8_draft": True,
                               "new_tokens": args.new_tokens, "prompt": "HumanEval 0", "decoding": "greedy"}}
    for method in ("sequoia", "specexec"):
        for call in ("first", "second"):
            start = time.perf_counter()
            out = models.target.generate(ids, assistant_model=models.draft, speculation=method, do_sample=False,
                                         max_new_tokens=args.new_tokens, return_dict_in_generate=True)
            stats = out.speculation_stats
            rows[f"{method}/{call}"] = {"wall_s": round(time.perf_counter() - start, 1),
                                        "time_plan_s": round(stats.time_plan, 1), "plan_source": stats.plan_source,
                                        "load_average": os.getloadavg()}
            print(method, call, rows[f"{method}/{call}"], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
