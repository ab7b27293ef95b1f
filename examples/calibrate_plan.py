"""Calibrate a Sequoia tree for your draft/target pair, then decode with it.

1. Measure how often the draft's 1st, 2nd, ... candidate is the token the target picks: a one-level tree of
   `width` children per step reads that straight off `speculation_stats.acceptance_by_rank()`.
2. `plan_tree` turns that acceptance vector into the tree with the most expected tokens per target step.
3. Decode with `speculation="tree", speculation_config={"parents": plan.parents}` and compare.
Run: `python examples/calibrate_plan.py` (or plan from the shell: `hf-specdec plan --acceptance ...`).
"""

from __future__ import annotations

import torch

import hf_specdec  # noqa: F401  (adds `speculation=` to generate)
from hf_specdec import SpeculationStats
from hf_specdec.planning import TreePlan, plan_tree

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "def is_palindrome(text: str) -> bool:\n",
    "class Stack:\n    def __init__(self):\n",
    "def merge_sorted(a, b):\n",
]


def measure_acceptance(target, draft, tokenizer, prompts: list[str], width: int = 8, max_new_tokens: int = 48):
    """Acceptance by rank over all prompts (their counters pooled, so long replies weigh more)."""
    pooled = SpeculationStats()
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(
            ids,
            assistant_model=draft,
            speculation="tree",
            speculation_config={"widths": [width]},  # one level: every step measures ranks 1..width once
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
        )
        pooled.accepted_ranks.update(out.speculation_stats.accepted_ranks)
        pooled.reached_depths.update(out.speculation_stats.reached_depths)
    return pooled.acceptance_by_rank()


def decode(target, draft, tokenizer, prompt: str, max_new_tokens: int, **speculation):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    out = target.generate(
        ids,
        assistant_model=draft,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        **speculation,
    )
    return torch.equal(out.sequences, plain), out.speculation_stats


def main(
    target,
    draft,
    tokenizer,
    prompts: list[str] | None = None,
    budget: int = 32,
    max_depth: int = 6,
    max_new_tokens: int = 64,
) -> dict:
    """Calibrate on all prompts but the last, plan, then compare default and planned trees on the last."""
    prompts = prompts or DEFAULT_PROMPTS
    calibration, held_out = prompts[:-1] or prompts, prompts[-1]
    acceptance = measure_acceptance(target, draft, tokenizer, calibration)
    if not any(acceptance):
        raise ValueError("The draft never matched the target on these prompts: no tree shape can help this pair.")
    plan: TreePlan = plan_tree(acceptance, budget=budget, max_depth=max_depth)
    print(f"acceptance by rank: {[round(p, 3) for p in acceptance]}")
    print(
        f"planned tree: {len(plan.parents)} nodes, widths per level {plan.widths_per_level()}, "
        f"{plan.expected_tokens:.2f} expected tokens per step"
    )
    results = {}
    for name, speculation in [
        ("default tree", {"speculation": "tree"}),
        ("planned tree", {"speculation": "tree", "speculation_config": {"parents": plan.parents}}),
    ]:
        identical, stats = decode(target, draft, tokenizer, held_out, max_new_tokens, **speculation)
        results[name] = {"identical": identical, "stats": stats}
        print(f"{name}: identical to plain {identical}, {stats.mean_tokens_per_step:.2f} tokens per target step")
    return {"acceptance": acceptance, "plan": plan, "results": results}


if __name__ == "__main__":
    from hf_specdec import models

    main(*models.load_default_pair(dtype=torch.bfloat16))
