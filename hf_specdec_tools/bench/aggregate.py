"""From raw per-call numbers to one row per strategy: medians over prompts and ratios against `plain`.

Speedup is computed per prompt (plain seconds per new token / strategy seconds per new token, so a call that
stopped early at EOS is compared fairly) and summarised by its median, min–max and interquartile range. Counts
(tokens per target step, draft passes per token, time split) are ratios of sums over every measured call.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import numpy as np

from .strategies import PLAIN

MIB = 2**20


def _per_prompt(calls: list[dict[str, Any]], label: str) -> dict[int, dict[str, float]]:
    """prompt -> median seconds and new tokens over that prompt's repeats."""
    grouped: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for call in calls:
        if call["strategy"] == label:
            grouped[call["prompt"]].append(call)
    return {
        prompt: {
            "seconds": statistics.median(c["seconds"] for c in group),
            "new_tokens": statistics.median(c["new_tokens"] for c in group),
            "identical": None if any(c["identical"] is None for c in group) else all(c["identical"] for c in group),
            "near_tie": any(c.get("difference") for c in group)
            and all(c["difference"]["near_tie"] for c in group if c.get("difference")),
        }
        for prompt, group in sorted(grouped.items())
    }


def _seconds_per_token(row: dict[str, float]) -> float:
    return row["seconds"] / max(row["new_tokens"], 1)


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None}
    q1, median, q3 = np.percentile(values, [25, 50, 75]).tolist()
    return {"median": median, "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _time_split(calls: list[dict[str, Any]]) -> dict[str, float | None]:
    """Fractions of hf_specdec's loop time, and the engine's own cost per step (ms), summed over calls."""
    stats = [c["speculation_stats"] for c in calls if c.get("speculation_stats")]
    if not stats:
        return {}
    total = {name: sum(s.get(name) or 0.0 for s in stats) for name in (
        "time_total", "time_prefill", "time_drafting", "time_verifying", "time_target_forward",
        "time_draft_forward", "time_engine", "target_forwards",
    )}
    split = {
        f"frac_{name.removeprefix('time_')}": _ratio(total[name], total["time_total"])
        for name in ("time_prefill", "time_drafting", "time_verifying", "time_target_forward", "time_draft_forward",
                     "time_engine")
    }
    steps = total["target_forwards"]
    split["engine_ms_per_step"] = _ratio(total["time_engine"] * 1000, steps)
    split["engine_seconds"] = total["time_engine"]
    return split


def summarize(calls: list[dict[str, Any]], strategies: list[dict[str, Any]], sampling: bool) -> list[dict[str, Any]]:
    """One row per strategy, in the order run; `plain` is the reference of every ratio."""
    plain = _per_prompt(calls, PLAIN)
    rows = []
    for strategy in strategies:
        label = strategy["label"]
        mine = [c for c in calls if c["strategy"] == label]
        prompts = _per_prompt(calls, label)
        speedups = [
            _seconds_per_token(plain[p]) / _seconds_per_token(row)
            for p, row in prompts.items()
            if p in plain and row["seconds"] > 0
        ]
        identical = [row["identical"] for row in prompts.values()]
        near_ties = sum(bool(row["near_tie"]) for row in prompts.values())
        reference = strategy["kind"] == "reference"  # another engine or dtype: its greedy path is its own
        not_compared = sampling or reference
        new_tokens = sum(c["new_tokens"] for c in mine)
        row = {
            "strategy": label,
            "name": strategy["name"],
            "kind": strategy["kind"],
            "settings": strategy["settings"],
            "prompts": len(prompts),
            "calls": len(mine),
            "new_tokens": new_tokens,
            "seconds": sum(c["seconds"] for c in mine),
            "tokens_per_s_median": statistics.median(r["new_tokens"] / r["seconds"] for r in prompts.values())
            if prompts
            else None,
            "speedup": _spread(speedups),
            "speedups": speedups,
            "tokens_per_target_step": _ratio(new_tokens, sum(c["target_steps"] for c in mine)),
            "target_passes": sum(c["target_passes"] for c in mine),
            "draft_passes": sum(c["draft_passes"] for c in mine),
            "draft_passes_per_token": None if reference else _ratio(sum(c["draft_passes"] for c in mine), new_tokens),
            "identical": None if not_compared else sum(bool(i) for i in identical),
            "compared": None if not_compared else len(identical),
            "near_ties": None if not_compared else near_ties,
            "identical_text": "n/a (sampling)" if sampling else "n/a (own numerics)" if reference
            else f"{sum(bool(i) for i in identical)}/{len(identical)}" + (f" ({near_ties} at a near-tie)" if near_ties
                                                                           else ""),
            "peak_rss_mib": None if reference else max((c["peak_rss_delta_bytes"] for c in mine), default=0) / MIB,
            "time_split": _time_split(mine),
        }
        rows.append(row)
    return rows
