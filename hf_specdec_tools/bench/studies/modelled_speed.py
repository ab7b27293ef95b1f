"""Methods compared by MODELLED time per token on the real pair: load-independent, so it can run on a busy machine.

Every model pass advances a modelled clock by what the stored latency curves (the pair's plan, measured on a quiet
machine) say a pass over that many tokens costs; the engine's clocks (`time.perf_counter` in the loop, the drafters
and the guard) read that clock instead of the wall. So the sizing's decisions follow the quiet curves (measured/
predicted = 1: the online corrections stay off), and what is reported depends on counts only: target pass sizes,
draft pass sizes, tokens per step. Plain's time per token is a one-token target pass.

    .venv/bin/python -m hf_specdec_tools.bench.studies.modelled_speed --prompts humaneval:4 --max-new-tokens 96
    python -m hf_specdec_tools.bench.studies.modelled_speed --prompts code:4 --max-new-tokens 96 \
        --output modelled-code.json

Loads the embedded pair as the bench does (`--dtype auto`: bfloat16 where this CPU multiplies it natively, else
float32; the target prepacked where measured faster, int8 draft); greedy unless --temperature. Outputs of all methods
are compared with the first method's (greedy: identical). `hf-assisted` is Transformers' assisted generation with the
same draft, its passes priced by the same curves (its prompt pass, which also emits the first token, left out as
ours is).

What a cheaper draft would buy, at today's acceptance: `--draft-cost-scales 1,0.76,0.001` runs every method once
per factor with the draft's curve multiplied by it, for the clock and for the sizing alike (step-sized trees grow
where drafting gets cheaper). The draft's outputs, and so what the target accepts, stay as they are: the factor
prices a faster draft of the same quality (kernels, a pruned output layer). `--whole-call` also times each prompt's
target and draft prompt pass here (wall clock, median of 3) and reports whole-call speedups, as `hf-specdec bench`
times a call: plain = the target's prompt pass + one one-token pass per further token; a method = the target's
prompt pass + the draft's (scaled) + its modelled decoding.

    python -m hf_specdec_tools.bench.studies.modelled_speed --prompts code:8 --max-new-tokens 64 --whole-call \
        --draft-cost-scales 1,0.76,0.001 --methods hf-assisted,sequoia,specexec
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
import hf_specdec.integration.generate as integration
from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, StagedConfig, TreeConfig
from hf_specdec.core.config import PlanRequest
from hf_specdec.methods.sequoia import lookup as plan_lookup
from hf_specdec.plan import guard
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.sizing import ROOT_PASS_TOKENS, HardwareProfile
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
CLOCKED = ("hf_specdec.decoding.loop", "hf_specdec.runtime.devices", "hf_specdec.methods.specexec.best_first",
           "hf_specdec.draft.guarded")


class ModelledClock:
    """A clock that moves only when a model runs, by the latency curves' time for that pass; records every pass."""

    def __init__(self, profile, target, draft) -> None:
        self.profile, self.now, self.passes, self.target, self.draft = profile, 0.0, [], target, draft
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


def scaled_draft(profile: HardwareProfile, scale: float) -> HardwareProfile:
    """`profile` with every draft pass `scale` times as dear."""
    curve = profile.draft
    return dataclasses.replace(profile, draft=LatencyCurve(curve.sizes, tuple(t * scale for t in curve.seconds),
                                                           curve.past_length))


def price_plans_with(scale: float) -> None:
    """Every call's plan (looked up as usual) carries its profile with the draft's curve scaled by `scale`: the
    step-sized drafters and the guard then size and judge by it. Guards of earlier factors are forgotten."""
    looked_up = plan_lookup.plan_for_call

    def scaled_plan(*args, **kwargs):
        plan, source = looked_up(*args, **kwargs)
        if getattr(plan, "profile", None) is not None and scale != 1:
            plan = dataclasses.replace(plan, profile=scaled_draft(plan.profile, scale))
        return plan, source

    integration.plan_for_call = scaled_plan
    guard._REMEMBERED.clear()


def prompt_pass_seconds(model, ids: torch.Tensor, repeats: int = 3) -> float:
    """Median wall seconds of `model`'s pass over the whole prompt, from an empty cache, logits for the last position
    only (as `generate`'s first pass)."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_method(name: str, prompts: list, clock: ModelledClock, profile: HardwareProfile, overhead: float,
               prefill: list[tuple[float, float]] | None, scale: float, args, reference: dict) -> dict:
    """One method over every prompt, priced by `profile` (its draft curve already scaled)."""
    target, draft = clock.target, clock.draft
    plain_per_token = float(profile.target(1)) + overhead
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
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
        row = {
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
        }
        if prefill is not None:
            # the draft's prompt pass replaces the root pass `modelled_seconds` priced its first pass as
            target_prompt, draft_prompt = prefill[index]
            first_draft = float(profile.draft(counts["draft_sizes"][0])) if counts["draft_sizes"] else 0.0
            call = target_prompt + seconds + (scale * draft_prompt - first_draft if counts["draft_sizes"] else 0.0)
            plain_call = target_prompt + plain_per_token * (stats.new_tokens - 1)
            row |= {"call_seconds": call, "plain_call_seconds": plain_call, "call_speedup": plain_call / call}
        per_prompt.append(row)
    tokens = sum(p["new_tokens"] for p in per_prompt)
    steps = sum(p["steps"] for p in per_prompt)
    result = {
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
    if prefill is not None:
        result["call_speedup_median"] = statistics.median(p["call_speedup"] for p in per_prompt)
        result["call_speedup_min"] = min(p["call_speedup"] for p in per_prompt)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval:4")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--step-overhead-ms", type=float, default=8.0,
                        help="engine time per step added to the modelled time (quiet Zen 4 bench: 5.6-12 ms)")
    parser.add_argument("--draft-cost-scales", default="1",
                        help="factors on the draft's latency curve, comma-separated: every method runs once per "
                             "factor, sized and priced with the scaled curve (acceptance unchanged)")
    parser.add_argument("--whole-call", action="store_true",
                        help="time each prompt's target and draft prompt pass here and report whole-call speedups")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    scales = [float(s) for s in args.draft_cost_scales.split(",")]
    if not scales or any(not s > 0 for s in scales):
        parser.error(f"--draft-cost-scales takes positive factors (0.001 for a nearly free draft), got "
                     f"{args.draft_cost_scales!r}")

    dtype = getattr(torch, resolve_dtype(args.dtype))
    models = load_models(dtype=dtype, int8_draft=True, prepack=True, progress=False)
    target, draft, tokenizer = models.target, models.draft, models.tokenizer
    prompts = tokenize_prompts(tokenizer, load_prompt_source(args.prompts))
    prefill = None
    if args.whole_call:
        prefill = [(prompt_pass_seconds(target, ids), prompt_pass_seconds(draft, ids)) for ids in prompts]
        print("prompt passes (s, target / draft): " + ", ".join(f"{t:.2f}/{d:.2f}" for t, d in prefill))
    plan, source = plan_lookup.plan_for_call(PlanRequest(max_budget=128, max_depth=12), target, draft,
                                             args.temperature, prompts[0])
    print(f"plan: {source}; acceptance {[round(p, 3) for p in plan.acceptance[:6]]}; tree {plan.parents}")
    overhead = args.step_overhead_ms / 1000
    reference: dict = {}
    by_scale = {}
    clock = ModelledClock(plan.profile, target, draft)
    clock.install()
    clock.record_planned_shapes()
    for scale in scales:
        clock.profile = profile = scaled_draft(plan.profile, scale)
        price_plans_with(scale)
        print(f"draft cost x{scale:g}: one-token pass {1000 * float(profile.draft(1)):.1f} ms, target "
              f"{1000 * float(profile.target(1)):.1f} ms")
        rows = {}
        for name in args.methods.split(","):
            rows[name] = r = run_method(name, prompts, clock, profile, overhead, prefill, scale, args, reference)
            whole = (f"  whole call {r['call_speedup_median']:.2f} (min {r['call_speedup_min']:.2f})"
                     if prefill is not None else "")
            print(f"{name:15s} {r['ms_per_token']:6.1f} ms/token  speedup {r['speedup_median']:.2f} (min "
                  f"{r['speedup_min']:.2f}){whole}  {r['tokens_per_step']:.2f} tok/step  "
                  f"{r['draft_passes_per_token']:.2f} draft passes/tok  target pass {r['mean_target_pass']:.1f}  "
                  f"plain {r['plain_steps']} shrunk {r['shrunk_steps']} of {r['steps']}  identical "
                  f"{r['identical']}", flush=True)
        by_scale[f"{scale:g}"] = rows
    plain_per_token = float(plan.profile.target(1)) + overhead
    print(f"plain           {1000 * plain_per_token:6.1f} ms/token (a one-token target pass + the step overhead)")
    if args.output:
        result = {"settings": vars(args) | {"output": str(args.output)}, "plan_source": source,
                  "plan_acceptance": list(plan.acceptance), "plain_ms_per_token": 1000 * plain_per_token,
                  "prompt_pass_seconds": prefill}
        # one factor keeps the file's earlier layout (what other READMEs' runs wrote)
        result |= {"methods": by_scale[f"{scales[0]:g}"]} if len(scales) == 1 else {"by_draft_cost_scale": by_scale}
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
