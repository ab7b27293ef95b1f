"""Methods compared by MODELLED time per token on the real pair: load-independent, so it can run on a busy machine.

Every model pass advances a modelled clock by what the stored latency curves (the pair's plan, measured on a quiet
machine) say a pass over that many tokens costs; the engine's clocks (`time.perf_counter` in the loop, the drafters
and the guard) read that clock instead of the wall. So the sizing's decisions follow the quiet curves (measured/
predicted = 1: the online corrections stay off), and what is reported depends on counts only: target pass sizes,
draft pass sizes, tokens per step. Plain's time per token is a one-token target pass.

    .venv/bin/python benchmarks/modelled_speed.py --prompts humaneval:4 --max-new-tokens 96
    .venv/bin/python benchmarks/modelled_speed.py --prompts code:4 --max-new-tokens 96 --output modelled-code.json

Loads the embedded pair as the bench does (`--dtype auto`: bfloat16 where this CPU multiplies it natively, else
float32; the target prepacked where measured faster, int8 draft); greedy unless --temperature. Outputs of all methods
are compared with the first method's (greedy: identical). `hf-assisted` is Transformers' assisted generation with the
same draft, its passes priced by the same curves (its prompt pass, which also emits the first token, left out as
ours is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, StagedConfig, TreeConfig
from hf_specdec.core.config import PlanRequest
from hf_specdec.plan import plan_lookup
from hf_specdec.plan.sizing import ROOT_PASS_TOKENS
from hf_specdec_tools.bench.cli import resolve_dtype
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models

METHODS = {
    "chain": ChainConfig(),
    "sequoia-static": SequoiaConfig(per_step=False),
    "sequoia": SequoiaConfig(),
    "specexec": SpecExecConfig(),
    "staged": StagedConfig(),
    "tree": TreeConfig(),
    "tree-static": TreeConfig(per_step=False),
    "hf-assisted": None,  # Transformers' assisted generation, same draft
}
#: modules whose `time.perf_counter` decides or measures while generating
CLOCKED = ("hf_specdec.decoding.loop", "hf_specdec.core.devices", "hf_specdec.draft.best_first",
           "hf_specdec.draft.guarded")


class ModelledClock:
    """A clock that moves only when a model runs, by the latency curves' time for that pass; records every pass."""

    def __init__(self, profile, target, draft) -> None:
        self.profile, self.now, self.passes = profile, 0.0, []
        target.register_forward_pre_hook(lambda m, a, k: self._tick("target", k), with_kwargs=True)
        draft.register_forward_pre_hook(lambda m, a, k: self._tick("draft", k), with_kwargs=True)

    def _tick(self, role: str, kwargs: dict) -> None:
        tokens = int(kwargs["input_ids"].shape[-1])
        self.passes.append((role, tokens))
        self.now += float(getattr(self.profile, role)(tokens))

    def record_planned_shapes(self) -> None:
        """Every shape a step-sized drafter chooses before drafting (its size), beside the passes."""
        from hf_specdec.draft.sized_shape import SizedShapeDrafter

        use_shape = SizedShapeDrafter.use_shape

        def recorded(drafter, parents):
            self.passes.append(("planned", len(parents)))
            return use_shape(drafter, parents)

        SizedShapeDrafter.use_shape = recorded

    def install(self) -> None:
        fake = types.SimpleNamespace(perf_counter=lambda: self.now, time=time.time, sleep=time.sleep)
        for name in CLOCKED:
            sys.modules[name].time = fake


def modelled_seconds(profile, passes: list[tuple[str, int]], overhead: float) -> tuple[float, dict]:
    """Decoding seconds of one call (the target's prompt pass left out, the draft's first pass counted as a root
    pass) and the counts behind them."""
    target = [n for role, n in passes if role == "target"][1:]
    draft = [n for role, n in passes if role == "draft"]
    draft = [min(draft[0], ROOT_PASS_TOKENS)] + draft[1:] if draft else []
    seconds = sum(float(profile.target(n)) for n in target) + sum(float(profile.draft(n)) for n in draft)
    planned = [n for role, n in passes if role == "planned"]
    return seconds + overhead * len(target), {"target_sizes": target, "draft_sizes": draft, "planned": planned}


def assisted_stats(new_tokens: int, steps: int) -> types.SimpleNamespace:
    """What the report reads of `speculation_stats`, for Transformers' assisted generation (counted from its passes:
    every target pass after the prompt's is a step)."""
    return types.SimpleNamespace(new_tokens=new_tokens, mean_tokens_per_step=new_tokens / max(steps, 1),
                                 tokens_per_step=[0] * steps, tokens_per_step_histogram={}, plain_steps=0,
                                 shrunk_steps=0, acceptance_by_rank=lambda: [], plan_source=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval:4")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--step-overhead-ms", type=float, default=8.0,
                        help="engine time per step added to the modelled time (quiet Zen 4 bench: 5.6-12 ms)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    dtype = getattr(torch, resolve_dtype(args.dtype))
    models = load_models(dtype=dtype, int8_draft=True, prepack=True, progress=False)
    target, draft, tokenizer = models.target, models.draft, models.tokenizer
    prompts = tokenize_prompts(tokenizer, load_prompt_source(args.prompts))
    plan, source = plan_lookup.plan_for_call(PlanRequest(max_budget=128, max_depth=12), target, draft,
                                             args.temperature, prompts[0])
    profile = plan.profile
    print(f"plan: {source}; acceptance {[round(p, 3) for p in plan.acceptance[:6]]}; tree {plan.parents}")
    clock = ModelledClock(profile, target, draft)
    clock.install()
    clock.record_planned_shapes()
    overhead = args.step_overhead_ms / 1000
    plain_per_token = float(profile.target(1)) + overhead
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    rows, reference = {}, {}
    for name in args.methods.split(","):
        per_prompt = []
        for index, ids in enumerate(prompts):
            start = len(clock.passes)
            torch.manual_seed(index)
            method = {} if METHODS[name] is None else {"speculation": METHODS[name]}
            out = target.generate(ids, assistant_model=draft, max_new_tokens=args.max_new_tokens,
                                  return_dict_in_generate=True, **method, **sampling)
            seconds, counts = modelled_seconds(profile, clock.passes[start:], overhead)
            stats = getattr(out, "speculation_stats", None) or assisted_stats(
                out.sequences.shape[1] - ids.shape[1], len(counts["target_sizes"]))
            same = reference.setdefault(index, out.sequences).equal(out.sequences)
            per_prompt.append({
                "identical_to_first_method": same, "new_tokens": stats.new_tokens,
                "ms_per_token": 1000 * seconds / stats.new_tokens,
                "speedup": plain_per_token * stats.new_tokens / seconds,
                "tokens_per_step": stats.mean_tokens_per_step,
                "draft_passes_per_token": len(counts["draft_sizes"]) / stats.new_tokens,
                "mean_target_pass": statistics.mean(counts["target_sizes"]),
                "mean_draft_pass": statistics.mean(counts["draft_sizes"]) if counts["draft_sizes"] else 0.0,
                "target_pass_sizes": dict(sorted(Counter(counts["target_sizes"]).items())),
                "planned_sizes": dict(sorted(Counter(counts["planned"]).items())),
                "draft_pass_sizes": dict(sorted(Counter(counts["draft_sizes"]).items())),
                "tokens_per_step_histogram": stats.tokens_per_step_histogram,
                "plain_steps": stats.plain_steps, "shrunk_steps": stats.shrunk_steps,
                "steps": len(stats.tokens_per_step), "acceptance_by_rank": stats.acceptance_by_rank()[:4],
                "plan_source": stats.plan_source,
            })
        tokens = sum(p["new_tokens"] for p in per_prompt)
        steps = sum(p["steps"] for p in per_prompt)
        rows[name] = {
            "speedup_median": statistics.median(p["speedup"] for p in per_prompt),
            "speedup_min": min(p["speedup"] for p in per_prompt),
            "ms_per_token": sum(p["ms_per_token"] * p["new_tokens"] for p in per_prompt) / tokens,
            "tokens_per_step": tokens / steps,
            "draft_passes_per_token": sum(p["draft_passes_per_token"] * p["new_tokens"] for p in per_prompt) / tokens,
            "mean_target_pass": sum(p["mean_target_pass"] * p["steps"] for p in per_prompt) / steps,
            "plain_steps": sum(p["plain_steps"] for p in per_prompt), "shrunk_steps": sum(p["shrunk_steps"]
                                                                                          for p in per_prompt),
            "steps": steps, "identical": all(p["identical_to_first_method"] for p in per_prompt),
            "per_prompt": per_prompt,
        }
        r = rows[name]
        print(f"{name:15s} {r['ms_per_token']:6.1f} ms/token  speedup {r['speedup_median']:.2f} (min "
              f"{r['speedup_min']:.2f})  {r['tokens_per_step']:.2f} tok/step  {r['draft_passes_per_token']:.2f} "
              f"draft passes/tok  target pass {r['mean_target_pass']:.1f}  plain {r['plain_steps']} shrunk "
              f"{r['shrunk_steps']} of {steps}  identical {r['identical']}", flush=True)
    print(f"plain           {1000 * plain_per_token:6.1f} ms/token (a one-token target pass + the step overhead)")
    if args.output:
        args.output.write_text(json.dumps({"settings": vars(args) | {"output": str(args.output)}, "plan_source": source,
                                           "plan_acceptance": list(plan.acceptance), "plain_ms_per_token":
                                           1000 * plain_per_token, "methods": rows}, indent=1))


if __name__ == "__main__":
    main()
