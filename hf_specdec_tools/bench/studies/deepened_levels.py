"""`sequoia` with and without levels grown below its chosen shape (`SizedShapeDrafter._deepen`), side by side.

    python -m hf_specdec_tools.bench.studies.deepened_levels --output benchmarks/results/xeon-amx/deepened-levels.json

The embedded pair as the bench loads it (bfloat16, the target prepacked, the draft "mixed"), greedy, general chat (48
new tokens) and code continuations (64). Per prompt, four calls interleaved (their order reversed every other
prompt): plain `generate`, Transformers' assisted generation, `sequoia` with its growth turned off, `sequoia` as it
is. One warm-up call of each first. Each call's seconds, tokens per step, steps, draft passes and grown levels are
recorded, and whether its tokens are plain's (bfloat16 tree passes can round a near-tie the other way). A summary of
speedups over plain (per prompt, median, min) is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.draft.sized_shape import SizedShapeDrafter
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models

SETS = (("chat", 48), ("code:6", 64))
RUNS = ("plain", "assisted (Transformers)", "sequoia, no growth", "sequoia")
GROWS = SizedShapeDrafter._deepen  # the drafter's own, put back after the study


def run_call(models, ids: torch.Tensor, name: str, new_tokens: int) -> dict:
    """One greedy call of `name` (growth switched on the class for the `sequoia` rows)."""
    kwargs = {}
    if name != "plain":
        kwargs["assistant_model"] = models.draft
    if name.startswith("sequoia"):
        kwargs["speculation"] = "sequoia"
        SizedShapeDrafter._deepen = GROWS if name == "sequoia" else (lambda self: False)
    start = time.perf_counter()
    out = models.target.generate(ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                                 **kwargs)
    row = {"name": name, "seconds": time.perf_counter() - start, "tokens": out.sequences[0, ids.shape[1]:].tolist()}
    stats = getattr(out, "speculation_stats", None)
    if stats is not None:
        row.update(tokens_per_step=stats.mean_tokens_per_step, steps=stats.target_forwards,
                   draft_passes=stats.draft_forwards, deepened_levels=stats.deepened_levels)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    models = load_models(dtype=torch.bfloat16, int8_draft=True, prepack=True, progress=False)
    rows = []
    try:
        for source, new_tokens in SETS:
            prompts = tokenize_prompts(models.tokenizer, load_prompt_source(source))
            for name in RUNS:  # warm-up
                run_call(models, prompts[0], name, 8)
            for index, ids in enumerate(prompts):
                calls = [run_call(models, ids, name, new_tokens) for name in (RUNS[::-1] if index % 2 else RUNS)]
                plain = next(call for call in calls if call["name"] == "plain")
                seconds, tokens = plain["seconds"], plain["tokens"]
                for call in calls:
                    call.update(set=source, prompt=index, speedup=seconds / call["seconds"],
                                same_as_plain=call.pop("tokens") == tokens)
                    print(json.dumps(call), flush=True)
                rows += calls
    finally:
        SizedShapeDrafter._deepen = GROWS
    for source, _ in SETS:
        for name in RUNS[1:]:
            speedups = [row["speedup"] for row in rows if row["set"] == source and row["name"] == name]
            print(f"{source} {name}: median {statistics.median(speedups):.2f}x plain, min {min(speedups):.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__}, "calls": rows}, indent=1))


if __name__ == "__main__":
    main()
