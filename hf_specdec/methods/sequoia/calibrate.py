"""Calibrate a Sequoia plan: measure acceptance and latency for a target/draft pair, then size and plan the tree.

    plan = calibrate(target, draft, prompt_ids, temperature=0.6)
    plan.save("my-pair.json")
    target.generate(ids, assistant_model=draft, speculation="sequoia", speculation_config={"plan": "my-pair.json"})
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import (
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ...plan.latency import DEFAULT_SIZES, STOP_RATIO, measure_latency
from ...plan.sizing import HardwareProfile, step_seconds
from ...runtime.attention import AttentionLayout
from ...runtime.devices import execution_device
from ...runtime.model_info import embeddable, vocab_size
from .acceptance import estimate_acceptance
from .dp import TreePlanner
from .plan_file import SequoiaPlan, environment, model_record, pair_placement
from .sizing import choose_plan


def sampling_processors(
    temperature: float, top_k: int | None = None, top_p: float | None = None
) -> LogitsProcessorList:
    """The warpers plain sampling applies (in generate's order), or none for greedy (temperature 0)."""
    processors = LogitsProcessorList()
    if temperature > 0:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    return processors


def default_verifier(temperature: float) -> str:
    return "greedy" if temperature <= 0 else "sequoia"


def measure_profile(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    past_length: int = 256,
    repeats: int = 3,
    progress: bool = True,
    target_stop_ratio: float | None = STOP_RATIO,
) -> HardwareProfile:
    """Latency curves of both models on their current device, dtype and offloading. `target_stop_ratio=None` times
    the target at every size: a target sharded over ranks must run the same passes on each, whatever its clock."""
    return HardwareProfile(
        target=measure_latency(target, sizes, past_length, repeats, progress, desc="latency target",
                               stop_ratio=target_stop_ratio),
        draft=measure_latency(draft, sizes, past_length, repeats, progress, desc="latency draft"),
        placement=pair_placement(target, draft),
    )


def reference_sequences(
    target: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    progress: bool = True,
) -> list[tuple[torch.Tensor, int]]:
    """The target's own continuations (greedy, or sampled at `temperature`) by plain `generate`: the contexts
    the plan will meet. (Not sped up by a tree: on CPUs without native bf16 a tree pass costs as many single passes.)
    """
    sequences = []
    for i, ids in enumerate(tqdm(prompts, desc="continuations", unit="prompt", disable=not progress)):
        ids = ids.reshape(1, -1)
        torch.manual_seed(seed + i)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        pad = target.generation_config.pad_token_id or target.generation_config.eos_token_id
        out = target.generate(ids, max_new_tokens=room(target, ids, max_new_tokens),
                              attention_mask=torch.ones_like(ids), pad_token_id=pad, **sampling)
        sequences.append((out[0].cpu(), ids.shape[1]))
    return sequences


def room(model: PreTrainedModel, ids: torch.Tensor, max_new_tokens: int) -> int:
    """`max_new_tokens`, or fewer where a learned position table ends first (GPT-2, OPT): calibration must not
    decode past the last position the model has."""
    limit = AttentionLayout.of(model).position_limit
    return max_new_tokens if limit is None else max(min(max_new_tokens, limit - ids.shape[-1]), 1)


def draft_sequences(
    draft: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int, vocab: int | None = None
) -> list[tuple[torch.Tensor, int]]:
    """Cheap stand-in continuations from the draft alone (greedy), for the short online calibration; with `vocab`
    (the target's rows), never a token past them (a draft padded to more rows than the target). A prompt token past
    the draft's input rows (a draft with fewer rows than the target) reaches the draft as its last row, as it does
    while drafting (`embeddable`); the sequence keeps the prompt as given."""
    out = []
    beyond = list(range(vocab, vocab_size(draft))) if vocab is not None else []
    rows = getattr(draft.get_input_embeddings(), "num_embeddings", None)
    for ids in prompts:
        ids = ids.reshape(1, -1).to(execution_device(draft))
        pad = draft.generation_config.pad_token_id or draft.generation_config.eos_token_id
        generated = draft.generate(embeddable(ids, rows), max_new_tokens=room(draft, ids, max_new_tokens),
                                   do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=pad,
                                   suppress_tokens=beyond or None)
        out.append((torch.cat([ids[0], generated[0, ids.shape[1]:]]).cpu(), ids.shape[1]))
    return out


def calibrate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    temperature: float = 0.0,
    verifier: str | None = None,
    width: int = 16,
    max_new_tokens: int = 64,
    max_budget: int = 128,
    max_depth: int = 12,
    profile: HardwareProfile | None = None,
    latency_sizes: Sequence[int] = DEFAULT_SIZES,
    top_k: int | None = None,
    top_p: float | None = None,
    online: bool = False,
    progress: bool = True,
    target_stop_ratio: float | None = STOP_RATIO,
) -> SequoiaPlan:
    """Acceptance (teacher-forced, see `acceptance.py`) + latency curves -> the tree minimising time per token.

    `online=True` is the short version `speculation="sequoia"` runs when it finds no plan: continuations come
    from the draft alone (cheap, slightly biased contexts) and latency is measured on fewer sizes.
    """
    start = time.perf_counter()
    verifier = verifier or default_verifier(temperature)
    if online:
        sequences = draft_sequences(draft, prompts, max_new_tokens, vocab_size(target))
    else:
        sequences = reference_sequences(target, prompts, max_new_tokens, temperature, progress=progress)
    processors = sampling_processors(temperature, top_k, top_p)
    estimate = estimate_acceptance(target, draft, sequences, width, verifier, processors, progress=progress)
    if profile is None:
        profile = measure_profile(target, draft, latency_sizes, repeats=1 if online else 3, progress=progress,
                                  target_stop_ratio=target_stop_ratio)
    sized = choose_plan(estimate.acceptance, profile, max_budget, max_depth)
    return SequoiaPlan(
        tree=sized.plan,
        temperature=float(temperature),
        verifier=verifier,
        profile=profile,
        target=model_record(target),
        draft=model_record(draft),
        acceptance_positions=estimate.positions,
        predicted={
            "tokens_per_step": sized.plan.expected_tokens,
            "seconds_per_step": sized.seconds_per_step,
            "seconds_per_token": sized.seconds_per_token,
        },
        candidates=sized.candidates,
        environment={**environment(), "calibration_seconds": round(time.perf_counter() - start, 2),
                     "prompts": len(prompts), "max_new_tokens": max_new_tokens, "width": width,
                     "top_k": top_k, "top_p": top_p},
        source="online calibration" if online else "calibrate command",
    )


def alternative_sizes(
    plan: SequoiaPlan, budgets: Sequence[int] = (8, 16, 32, 64, 128), slack: float = 2.0
) -> list[tuple[int, int]]:
    """(budget, depth) of the chosen tree, then of the best candidate at each of `budgets` whose predicted time
    per token is within `slack` times the chosen one's: the trees `evaluate_plan` decodes to check predictions
    (trees predicted far slower are not worth minutes of decoding)."""
    chosen = (plan.tree.budget, plan.tree.max_depth)
    limit = slack * plan.predicted["seconds_per_token"]
    picks = [chosen]
    for budget in budgets:
        rows = [c for c in plan.candidates if c["budget"] == budget]
        if rows:
            best = min(rows, key=lambda c: c["seconds_per_token"])
            if (best["budget"], best["max_depth"]) not in picks and best["seconds_per_token"] <= limit:
                picks.append((best["budget"], best["max_depth"]))
    return picks


def evaluate_plan(
    plan: SequoiaPlan,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int = 64,
    sizes: Sequence[tuple[int, int]] | None = None,
    progress: bool = True,
) -> dict:
    """Decode held-out prompts with the planned tree (and other sizes): measured against predicted figures.

    Seconds per token exclude the prompt's prefill, as the prediction does.
    """
    sizes = list(sizes or alternative_sizes(plan))
    planner = TreePlanner(plan.acceptance, max(b for b, _ in sizes), max(d for _, d in sizes))
    sampling = {"do_sample": True, "temperature": plan.temperature} if plan.temperature > 0 else {"do_sample": False}
    rows = []
    bar = tqdm(total=len(sizes) * len(prompts), desc="held-out decoding", unit="run", disable=not progress)
    seen: list[list[int]] = []
    for budget, depth in sizes:
        tree = planner.plan(budget, depth)
        if tree.parents in seen:  # e.g. every budget at depth 1 is the root alone
            bar.update(len(prompts))
            continue
        seen.append(tree.parents)
        variant = SequoiaPlan(**{**plan.__dict__, "tree": tree})
        steps = tokens = 0
        seconds = 0.0
        for i, ids in enumerate(prompts):
            ids = ids.reshape(1, -1)
            torch.manual_seed(i)
            out = target.generate(
                ids, assistant_model=draft, speculation="sequoia", speculation_config={"plan": variant},
                max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                **sampling,
            )
            stats = out.speculation_stats
            steps, tokens = steps + stats.target_forwards, tokens + stats.new_tokens
            seconds += stats.time_total - stats.time_prefill
            bar.update()
        predicted_step = step_seconds(tree.parents, plan.profile) if plan.profile else float("nan")
        rows.append({
            "budget": budget, "depth": depth, "nodes": len(tree.parents),
            "predicted_tokens_per_step": tree.expected_tokens, "measured_tokens_per_step": tokens / max(steps, 1),
            "predicted_seconds_per_token": predicted_step / tree.expected_tokens,
            "measured_seconds_per_token": seconds / max(tokens, 1),
        })
    bar.close()
    chosen = rows[0]
    return {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "tokens_per_step": chosen["measured_tokens_per_step"],
        "seconds_per_token": chosen["measured_seconds_per_token"],
        "trees": rows,
    }


def resize(plan: SequoiaPlan, profile: HardwareProfile, max_budget: int, max_depth: int, source: str) -> SequoiaPlan:
    """The same acceptance vector re-planned for other hardware: what a plan made elsewhere becomes here."""
    sized = choose_plan(plan.acceptance, profile, max_budget, max_depth)
    return dataclasses.replace(
        plan,
        tree=sized.plan,
        profile=profile,
        predicted={
            "tokens_per_step": sized.plan.expected_tokens,
            "seconds_per_step": sized.seconds_per_step,
            "seconds_per_token": sized.seconds_per_token,
        },
        measured={},
        candidates=sized.candidates,
        environment={**environment(), "acceptance_from": plan.environment},
        source=source,
    )
