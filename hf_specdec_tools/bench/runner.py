"""The benchmark loop: every strategy on every prompt in one process, interleaved per prompt, after a warm-up.

Interleaving (all strategies on prompt 1, then all on prompt 2, ...) exposes every strategy to the same machine
state, which matters on a shared CPU; the order rotates by one strategy per prompt and repeat so no strategy
always runs first. Every figure is later divided by `plain`'s on the same prompt. With `bracket_plain`, plain runs
first and last in every round and the ratios divide by the mean of its two calls: on a 2-core Xeon plain's own
seconds a token moved 0.16-0.34 within one set, and one plain call's minute decided whether a method "lost" a prompt.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .aggregate import summarize
from .measure import ForwardCounter, PeakMemory
from .strategies import PLAIN, Strategy

#: SpeculationStats fields copied into every hf_specdec call's record (timings in seconds)
STATS_FIELDS = (
    "time_prefill",
    "time_drafting",
    "time_verifying",
    "time_target_forward",
    "time_draft_forward",
    "time_engine",
    "time_total",
    "mean_tokens_per_step",
    "target_forwards",
    "draft_forwards",
)

#: the clock of the time limit (a name of its own so tests can drive it without touching the measured timings)
run_clock = time.perf_counter


@dataclass
class BenchSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy; > 0: do_sample=True at this temperature
    top_k: int | None = None  # with sampling: generate's top_k (None: the generation config's, 50 by default)
    top_p: float | None = None  # with sampling: generate's top_p (None: the generation config's, 1.0 by default)
    repeats: int = 1  # measured calls per (prompt, strategy); the per-prompt figure is their median
    warmup: int = 1  # unmeasured calls per strategy before measuring
    warmup_tokens: int = 8  # new tokens of each warm-up call
    seed: int = 0  # torch.manual_seed(seed + prompt index) before every call
    max_seconds: float | None = None  # no new prompt starts when the run would pass this (warm-up included)
    bracket_plain: bool = False  # plain runs first and last in every round; ratios divide by its two calls' mean

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def validate(self) -> None:
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be 0 or more, got {self.warmup}.")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}.")
        if (self.top_k is not None or self.top_p is not None) and not self.sampling:
            raise ValueError("--top-k and --top-p shape sampling: give --temperature > 0 with them.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"--top-k must be 0 (off) or more, got {self.top_k}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}.")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"--max-minutes must be positive, got {self.max_seconds / 60:g}.")


def generate_kwargs(settings: BenchSettings, max_new_tokens: int) -> dict[str, Any]:
    """What every strategy's call shares: token budget, greedy or sampling, a dict output (for the stats)."""
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": settings.sampling,
        "return_dict_in_generate": True,
    }
    if settings.sampling:
        kwargs["temperature"] = settings.temperature
        for name in ("top_k", "top_p"):
            if getattr(settings, name) is not None:
                kwargs[name] = getattr(settings, name)
    return kwargs


def plain_reference_calls(model: PreTrainedModel, prompts: dict[int, torch.LongTensor], settings: BenchSettings,
                          label: str, progress: bool = True) -> list[dict[str, Any]]:
    """Plain `generate` on `model` for a reference row run after the measured ones: one short warm-up call, then
    `settings.repeats` calls per prompt (keyed by its index in the run, which seeds it as the other rows' calls were),
    recorded as the bench's own calls are, under `label`."""
    counters = {"target": ForwardCounter(model)}
    plain = Strategy(PLAIN)
    try:
        measure_call(model, None, counters, plain, next(iter(prompts.values())), settings, settings.seed,
                     settings.warmup_tokens)
        calls = []
        for index, input_ids in tqdm(prompts.items(), desc=label, unit="prompt", disable=not progress):
            for repeat in range(settings.repeats):
                record, _ = measure_call(model, None, counters, plain, input_ids, settings, settings.seed + index)
                calls.append({"prompt": index, "repeat": repeat, **record, "strategy": label})
    finally:
        for counter in counters.values():
            counter.remove()
    return calls


def measure_call(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    counters: dict[str, ForwardCounter],
    strategy: Strategy,
    input_ids: torch.LongTensor,
    settings: BenchSettings,
    seed: int,
    max_new_tokens: int | None = None,
) -> tuple[dict[str, Any], torch.LongTensor]:
    """One `generate` call, timed and counted: (raw record, output sequence)."""
    kwargs = {
        **generate_kwargs(settings, max_new_tokens or settings.max_new_tokens),
        **strategy.generate_kwargs(draft),
        "attention_mask": torch.ones_like(input_ids),
    }
    for counter in counters.values():
        counter.take()
    torch.manual_seed(seed)
    with PeakMemory() as memory:
        start = time.perf_counter()
        out = target.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
    target_passes = counters["target"].take()
    draft_passes = counters["draft"].take() if "draft" in counters else 0
    new_tokens = int(out.sequences.shape[1] - input_ids.shape[1])
    stats = getattr(out, "speculation_stats", None)
    # A target "step" is a pass that emits tokens. Every pass of Transformers' loops does (its first pass reads the
    # prompt and emits the first token); hf_specdec's loop reads the prompt in a separate prefill pass that emits
    # none, so its steps are the engine's tree passes and the rest of the hooked passes are prefill.
    target_steps = int(stats.target_forwards) if stats is not None else target_passes
    record: dict[str, Any] = {
        "strategy": strategy.label,
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "identical": None,
        "target_passes": target_passes,
        "target_prefill_passes": target_passes - target_steps,
        "target_steps": target_steps,
        "tokens_per_target_step": new_tokens / target_steps if target_steps else None,
        "draft_passes": draft_passes,
        "draft_passes_per_token": draft_passes / new_tokens if new_tokens else None,
        "rss_before_bytes": memory.before,
        "peak_rss_delta_bytes": memory.delta,
        "speculation_stats": _stats_record(stats),
    }
    return record, out.sequences


def first_difference(
    target: PreTrainedModel, plain: torch.LongTensor, other: torch.LongTensor, prompt_length: int
) -> dict[str, Any]:
    """Where `other` first leaves `plain`, and by what margin plain's own pass chose there.

    In bfloat16 a tree pass's logits differ from a one-token pass's by rounding (attention over more rows: up to
    0.16 on the 1.5B target, where one rounding step of a logit near 20 is 0.125), so where the two best logits lie
    within that, greedy speculation may pick the other, as Transformers' assisted generation may. `near_tie` says
    the margin is within two rounding steps, at that logit, of the dtype the target computes in (its logits may be
    upcast after the rounding happened); a wider margin is a real fault.
    """
    length = min(plain.shape[1], other.shape[1])
    unequal = (plain[0, :length] != other[0, :length]).nonzero()
    if len(unequal) == 0:  # one stopped earlier: same tokens as far as both go
        return {"new_token": length - prompt_length, "margin": None, "rounding_step": None, "near_tie": False}
    at = int(unequal[0])
    with torch.no_grad():
        logits = target(input_ids=plain[:, :at], logits_to_keep=1).logits[0, -1]
    chosen, taken = logits[plain[0, at]], logits[other[0, at]]
    margin = float(chosen.float() - taken.float())
    exponent = torch.frexp(chosen.float().abs()).exponent - 1  # chosen lies in [2**e, 2**(e + 1))
    step = float(torch.finfo(target.dtype).eps * 2.0 ** exponent)
    return {"new_token": at - prompt_length, "margin": margin, "rounding_step": step, "near_tie": margin <= 2 * step}


def _stats_record(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    record = dict(stats.as_dict()) if hasattr(stats, "as_dict") else {}
    for name in STATS_FIELDS:
        record[name] = getattr(stats, name, record.get(name))
    return record


def run_benchmark(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    prompts: list[torch.LongTensor],
    strategies: list[Strategy],
    settings: BenchSettings,
    progress: bool = True,
) -> dict[str, Any]:
    """Warm up, then measure every (prompt, repeat, strategy); returns settings, strategies, raw calls, summary."""
    settings.validate()
    if not prompts:
        raise ValueError("No prompts to benchmark: give at least one with --prompts.")
    if not strategies or strategies[0].label != PLAIN:
        raise ValueError("The first strategy must be `plain`: every figure is relative to it (resolve_strategies).")
    counters = {"target": ForwardCounter(target)}
    if draft is not None:
        counters["draft"] = ForwardCounter(draft)
    calls: list[dict[str, Any]] = []
    first_calls: list[dict[str, Any]] = []
    interrupted, stopped_at = False, None
    start = run_clock()
    try:
        first_calls = _warm_up(target, draft, counters, strategies, prompts[0], settings, progress)
        bar = tqdm(total=len(prompts) * settings.repeats * (len(strategies) + settings.bracket_plain), desc="bench",
                   unit="call", disable=not progress)
        with bar:
            rounds_start = run_clock()
            for index, input_ids in enumerate(prompts):
                if index and _out_of_time(settings.max_seconds, start, (run_clock() - rounds_start) / index):
                    stopped_at = index
                    break
                for repeat in range(settings.repeats):
                    order = _round_order(strategies, index + repeat, settings.bracket_plain)
                    outputs: dict[str, torch.LongTensor] = {}
                    for strategy in order:
                        bar.set_postfix_str(f"prompt {index + 1}/{len(prompts)} {strategy.label}")
                        record, outputs[strategy.label] = measure_call(
                            target, draft, counters, strategy, input_ids, settings, settings.seed + index
                        )
                        calls.append({"prompt": index, "repeat": repeat, **record})
                        bar.update()
                    if not settings.sampling:  # greedy: every strategy must reproduce plain token for token
                        for call in calls[-len(order) :]:
                            call["identical"] = bool(torch.equal(outputs[call["strategy"]].cpu(),
                                                                 outputs[PLAIN].cpu()))
                            if not call["identical"]:
                                call["difference"] = first_difference(target, outputs[PLAIN],
                                                                      outputs[call["strategy"]], input_ids.shape[1])
    except KeyboardInterrupt:  # keep what was measured: a long run stopped early still reports its prompts
        interrupted = True
        rounds = Counter((c["prompt"], c["repeat"]) for c in calls)
        whole = len(strategies) + settings.bracket_plain
        calls = [c for c in calls if rounds[c["prompt"], c["repeat"]] == whole]
    finally:
        for counter in counters.values():
            counter.remove()
    return {
        "interrupted": interrupted,
        "time_limited": None if stopped_at is None else {"prompts_measured": stopped_at, "prompts_given": len(prompts),
                                                         "max_seconds": settings.max_seconds},
        "settings": dataclasses.asdict(settings),
        "strategies": [s.to_dict() for s in strategies],
        "first_calls": first_calls,
        "calls": calls,
        "summary": summarize(calls, [s.to_dict() for s in strategies], sampling=settings.sampling),
    }


def _round_order(strategies: list[Strategy], shift: int, bracket_plain: bool) -> list[Strategy]:
    """One round's calls: the strategies rotated by `shift`; with `bracket_plain`, plain (`strategies[0]`) first and
    last and the others rotated between, so each method's call lies between two of plain's."""
    if not bracket_plain:
        shift %= len(strategies)
        return strategies[shift:] + strategies[:shift]
    others = strategies[1:]
    shift %= max(len(others), 1)
    return [strategies[0], *others[shift:], *others[:shift], strategies[0]]


def _out_of_time(max_seconds: float | None, start: float, seconds_per_prompt: float) -> bool:
    """Whether one more prompt, taking as long as the average one so far, would end past `max_seconds`."""
    return max_seconds is not None and run_clock() - start + seconds_per_prompt > max_seconds


def _warm_up(target, draft, counters, strategies, input_ids, settings, progress) -> list[dict[str, Any]]:
    """Unmeasured short calls of every strategy: first-call costs (allocator, thread pools, lazy init, a plan looked
    up or re-sized for this hardware) go here, out of the measured rows. Returns each strategy's first call: its
    seconds, and the plan lookup's seconds and source where it has one."""
    first: list[dict[str, Any]] = []
    if settings.warmup == 0:
        return first
    tokens = min(settings.warmup_tokens, settings.max_new_tokens)
    with tqdm(total=settings.warmup * len(strategies), desc="warm-up", unit="call", disable=not progress) as bar:
        for _ in range(settings.warmup):
            for strategy in strategies:
                record, _ = measure_call(target, draft, counters, strategy, input_ids, settings, settings.seed, tokens)
                if len(first) < len(strategies):
                    stats = record.get("speculation_stats") or {}
                    first.append({"strategy": strategy.label, "seconds": record.get("seconds"),
                                  "time_plan": stats.get("time_plan"), "plan_source": stats.get("plan_source")})
                bar.update()
    return first
