"""Calibrate a Sequoia plan for your draft/target pair, save it, and decode with it.

`hf_specdec.calibrate` decodes the target's own continuations of your prompts, estimates how often the draft's
1st, 2nd, ... candidate is the token the target takes (the acceptance vector), times both models against tree
size on this machine, and returns the tree that minimises predicted time per token, as a JSON-saveable plan.
The command line does the same with plots: `hf-specdec calibrate --prompts my_prompts.jsonl --save`.
Run: `python examples/calibrate_plan.py`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import hf_specdec
from hf_specdec import SequoiaPlan

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "def is_palindrome(text: str) -> bool:\n",
    "class Stack:\n    def __init__(self):\n",
    "def merge_sorted(a, b):\n",
]


def main(
    target,
    draft,
    tokenizer,
    prompts: list[str] | None = None,
    max_budget: int = 32,
    max_depth: int = 6,
    max_new_tokens: int = 64,
    latency_sizes: tuple[int, ...] = (1, 4, 8, 16, 32),
) -> dict:
    """Calibrate on all prompts but the last, save and reload the plan, then decode the last one with it."""
    prompts = prompts or DEFAULT_PROMPTS
    calibration, held_out = prompts[:-1] or prompts, prompts[-1]
    encoded = [tokenizer(p, return_tensors="pt").input_ids[0] for p in calibration]
    plan = hf_specdec.calibrate(target, draft, encoded, max_new_tokens=max_new_tokens, max_budget=max_budget,
                                max_depth=max_depth, latency_sizes=latency_sizes)
    print(f"acceptance by rank: {[round(p, 3) for p in plan.acceptance]}")
    print(f"planned tree: {len(plan.parents)} nodes, widths per level {plan.tree.widths_per_level()}, "
          f"{plan.predicted['tokens_per_step']:.2f} expected tokens per step")

    path = plan.save(Path(tempfile.mkdtemp()) / "plan.json")  # JSON: the tree, the vector, the curves, the models
    ids = tokenizer(held_out, return_tensors="pt").input_ids
    plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    out = target.generate(ids, assistant_model=draft, speculation="sequoia", speculation_config={"plan": str(path)},
                          max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    stats = out.speculation_stats
    identical = torch.equal(out.sequences, plain)
    print(f"plan from {stats.plan_source}: identical to plain {identical}, "
          f"{stats.mean_tokens_per_step:.2f} tokens per target step")
    return {"plan": SequoiaPlan.load(path), "identical": identical, "stats": stats}


if __name__ == "__main__":
    from hf_specdec_tools import models

    main(*models.load_default_pair(dtype=torch.bfloat16))
