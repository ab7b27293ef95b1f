"""The draft's pass over the prompt, per way to run the 0.5B draft: what a speculative call pays that plain does not.

    .venv/bin/python -m hf_specdec_tools.bench.studies.draft_prompt_pass --prompts code:8 \
        --output benchmarks/results/zen4/draft-cost/prompt-pass

Every call's first draft pass reads the whole prompt (up to `draft_window` tokens): on code prompts of 44-438 tokens
it is a quarter of the target's prompt pass, and the target's pass is all plain pays besides its one-token passes.
This times that pass (from an empty cache, logits of the last position only, as the drafter runs it) for each
variant of the embedded draft: `quantize_draft`'s schemes and the draft in the target's dtype, default kernels and
prepacked; and the prepacked target's for the ratio. Interleaved: every round times every variant on every prompt;
the figure is the median over rounds. Writes results.json and README.md (the tables) to --output.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import warnings
from pathlib import Path

import torch

from hf_specdec import prepack, quantize_draft
from hf_specdec_tools import models
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts

from .modelled_speed import prompt_pass_seconds  # noqa: E402

SCHEMES = ("mixed", "dynamic-int8", "int4")


def variants(draft, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """Each way to run the draft, by name."""
    name = str(dtype).removeprefix("torch.")
    packed = copy.deepcopy(draft).eval()
    built = {name: draft.eval()}
    if prepack(packed, measure=False).packed:
        built[f"{name}-prepacked"] = packed
    return built | {scheme: quantize_draft(draft, scheme=scheme) for scheme in SCHEMES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="code:8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/draft-prompt-pass"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", category=UserWarning)
    dtype = getattr(torch, resolve_dtype(args.dtype))
    target, draft, tokenizer = models.load_default_pair(dtype=dtype, progress=False)
    prepack(target, measure=False)
    runs = {"target": target} | variants(draft, dtype)
    prompts = tokenize_prompts(tokenizer, load_prompt_source(args.prompts))
    for model in runs.values():  # a warm-up pass each (first-call allocations, oneDNN primitives)
        prompt_pass_seconds(model, prompts[0], repeats=1)
    load_before = os.getloadavg()
    timings: dict[str, list[list[float]]] = {name: [[] for _ in prompts] for name in runs}
    for _ in range(args.rounds):
        for index, ids in enumerate(prompts):
            for name, model in runs.items():
                timings[name][index].append(prompt_pass_seconds(model, ids, repeats=1))
    load_after = os.getloadavg()
    ms = {name: [round(1000 * statistics.median(t), 1) for t in per_prompt] for name, per_prompt in timings.items()}
    lengths = [int(ids.shape[1]) for ids in prompts]
    lines = ["| pass | " + " | ".join(f"{n} tokens" for n in lengths) + " | sum | sum / target's |",
             "|---|" + "---|" * (len(lengths) + 2)]
    for name, row in ms.items():
        lines.append(f"| {name} | " + " | ".join(str(t) for t in row) +
                     f" | {sum(row):.0f} | {sum(row) / sum(ms['target']):.3f} |")
    (args.output / "results.json").write_text(json.dumps({
        "environment": collect_environment(), "dtype": str(dtype), "prompts": args.prompts, "rounds": args.rounds,
        "prompt_tokens": lengths, "ms": ms, "loadavg_before_after": [load_before, load_after], "table": lines},
        indent=1))
    (args.output / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
