"""Write a benchmark's results: results.json (every raw number), results.md (a table) and PNG plots.

Everything here reads only the results dict, so `hf-specdec bench report results.json` can redraw a committed
run without models. Plots use matplotlib's object API (`Figure` renders with Agg), so no GUI backend is touched.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

GIB = 2**30
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
PLOTS = {
    "speedup": "speedup.png",
    "tokens_per_step": "tokens_per_step.png",
    "time_split": "time_split.png",
    "budget": "speedup_vs_budget.png",
}


def write_json(results: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def load_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No results file at {path}: run `hf-specdec bench` first, or give its results.json.")
    results = json.loads(path.read_text(encoding="utf-8"))
    if "summary" not in results or "calls" not in results:
        raise ValueError(f"{path} is not a `hf-specdec bench` results file (no `summary` / `calls`).")
    return results


# --- text -------------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _model(info: dict[str, Any] | None) -> str:
    if not info:
        return "none"
    count = info["parameters"]
    size = f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M" if count >= 1e6 else f"{count:,}"
    return f"{info['name']} ({size} parameters)"


def _flags(env: dict[str, Any]) -> str:
    details = [env["cpu_family_model"]] if env.get("cpu_family_model") else []
    details += [flag.upper() for flag in env.get("cpu_flags") or []]
    return f" ({', '.join(details)})" if details else ""


def machine_line(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    load = env.get("load_average_1_5_15")
    load_text = f"; load average {load[0]:.1f} at start" if load else ""
    if env.get("load_average_end"):
        load_text += f", {env['load_average_end'][0]:.1f} at end"
    memory = env.get("memory_total_bytes")
    return (
        f"**Machine:** {env.get('cpu', '?')}{_flags(env)}, {env.get('cpu_count_logical', '?')} logical cores, "
        f"{env.get('torch_threads', '?')} torch threads, {_fmt(memory and memory / GIB, '.0f', ' GiB')} RAM, "
        f"accelerator: {env.get('accelerator', '?')}{load_text}. {versions}. {env.get('date', '')}"
    )


def settings_line(results: dict[str, Any]) -> str:
    models = results.get("models", {})
    settings = results.get("settings", {})
    decoding = _decoding(settings, "sampling at temperature ")
    offload = models.get("offload")
    offload_text = (
        f", target offloaded to disk with {offload['max_memory_bytes'] / GIB:.2f} GiB kept in RAM" if offload else ""
    )
    prompts = settings.get("prompts", "?")
    count = len({c["prompt"] for c in results.get("calls", [])})
    return (
        f"**Settings:** target {_model(models.get('target'))}, draft {_model(models.get('draft'))}"
        f"{', quantized ' + models['draft_quantization'] if models.get('draft_quantization') else ''}, "
        f"{models.get('dtype', '?')}{offload_text}; {count} prompts ({prompts}) × {settings.get('max_new_tokens')} "
        f"new tokens, {decoding}, {settings.get('repeats', 1)} repeat(s) after {settings.get('warmup', 0)} "
        "warm-up call(s) per strategy, interleaved per prompt"
        + ("; plain run first and last on every prompt, ratios against the mean of its two calls."
           if settings.get("bracket_plain") else ".")
        + (" **Interrupted:** only the prompts every strategy finished are reported." if results.get("interrupted")
           else "")
        + _time_limited_text(results.get("time_limited"))
        + _kernels_text(models.get("kernels"))
        + _quantized_target_text(models.get("target_quantization"))
        + _llama_cpp_text(results.get("llama_cpp"))
        + _plain_bfloat16_text(results.get("plain_bfloat16"))
        + _one_row_packing_text(results.get("plain_one_row_packing"))
    )


def route_timings(timings: dict[str, dict]) -> str:
    """`none 92.0/117.1 ms; int8 ...`: ms per pass over 1 and 16 tokens of each route timed (JSON keys are text)."""
    return "; ".join(f"{route} {ms.get('1', ms.get(1))}/{ms.get('16', ms.get(16))} ms" for route, ms in timings.items())


def _quantized_target_text(quantized: dict[str, Any] | None) -> str:
    """The target's quantization route; with `auto`, what each route measured here."""
    if not quantized or (quantized.get("route") == "none" and quantized.get("requested") in (None, "none")):
        return ""
    text = f" Target: {quantized['description']}"
    timings = quantized.get("ms_per_pass_by_route")
    if timings:
        text += f", picked automatically as the fastest pass over 1/16 tokens here ({route_timings(timings)})"
    return text + "; plain `generate` ran on the same target."


def _llama_cpp_text(llama: dict[str, Any] | None) -> str:
    if not llama:
        return ""
    if "skipped" in llama:
        return f" llama.cpp row skipped: {llama['skipped']}."
    return (f" `llama.cpp`: llama-cpp-python {llama.get('version')} decoding {llama['gguf']} (the file the target "
            "was converted from) greedily, same prompts, threads and token budget, run after the other rows.")


def _reference_row_text(row: dict[str, Any] | None, label: str, text: str) -> str:
    """A plain reference row's sentence: `text` where it ran, why not where it was skipped, nothing if not asked."""
    if not row:
        return ""
    return f" {label} row skipped: {row['skipped']}." if "skipped" in row else text


def _one_row_packing_text(row: dict[str, Any] | None) -> str:
    return _reference_row_text(row, "plain (packed for 1 row)", (
        " `plain (packed for 1 row)`: plain `generate` on the same target repacked for one-token passes (the "
        "other rows share the packing for 16-token passes), same prompts and seeds, run after the other rows; "
        "its speedup is against plain on that packing, its outputs are not compared."))


def _plain_bfloat16_text(row: dict[str, Any] | None) -> str:
    return _reference_row_text(row, "plain (bfloat16)", (
        " `plain (bfloat16)`: plain `generate` on the target loaded again in bfloat16 (this CPU has no native "
        "bfloat16, so the run itself is float32; a one-token bfloat16 pass reads half the bytes), same prompts and "
        "seeds, run after the other rows; its speedup is against float32 plain, its outputs are not compared."))


def _kernels_text(kernels: dict[str, Any] | None) -> str:
    """What `--prepack` did to each model, with the pass times it measured (plain generate ran on the same models)."""
    parts = []
    for role, report in (kernels or {}).items():
        if report.get("prepacked"):
            before, after = report.get("ms_before") or {}, report.get("ms_after") or {}
            timing = ", ".join(f"{n} token(s) {before[n]:.0f} → {after[n]:.0f} ms" for n in before if n in after)
            parts.append(f"{role} Linear weights prepacked for oneDNN ({timing})" if timing else
                         f"{role} Linear weights prepacked for oneDNN")
    if not parts:
        return ""
    return f" Kernels: {'; '.join(parts)}; every strategy, plain `generate` included, ran on the same prepared models."


def _time_limited_text(limited: dict[str, Any] | None) -> str:
    if not limited:
        return ""
    return (
        f" Stopped by the time limit ({limited['max_seconds'] / 60:g} min) after {limited['prompts_measured']} of "
        f"{limited['prompts_given']} prompts."
    )


def caption(results: dict[str, Any]) -> str:
    """One short line for plot titles: machine, dtype, models, workload."""
    env, models, settings = results.get("environment", {}), results.get("models", {}), results.get("settings", {})
    draft = models.get("draft") or {}
    return (
        f"{env.get('cpu', '?')}{_flags(env)}, torch threads: {env.get('torch_threads', '?')}, "
        f"{models.get('dtype', '?')}"
        f"{' (offloaded)' if models.get('offload') else ''}\n"
        f"target {(models.get('target') or {}).get('name', '?')}, draft {draft.get('name', 'none')}"
        f"{' (' + models['draft_quantization'] + ')' if models.get('draft_quantization') else ''}\n"
        f"{len({c['prompt'] for c in results.get('calls', [])})} prompts × {settings.get('max_new_tokens')} tokens, "
        f"{_decoding(settings, 'T=')}"
    )


def _decoding(settings: dict[str, Any], temperature_prefix: str) -> str:
    """greedy, or the temperature with the top-k / top-p the run set."""
    if not settings.get("temperature"):
        return "greedy"
    extra = [f"{name.replace('_', '-')} {settings[name]}" for name in ("top_k", "top_p")
             if settings.get(name) is not None]
    return f"{temperature_prefix}{settings['temperature']}" + (f" ({', '.join(extra)})" if extra else "")


def markdown_table(summary: list[dict[str, Any]]) -> str:
    """One row per strategy; columns explained in the notes under the table."""
    lines = [
        "| strategy | identical to plain | tokens/s | speedup | speedup min–max (IQR) | tokens / target step "
        "| draft passes / token | time: draft · target · engine | engine ms / step | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        speedup = row["speedup"]
        split = row.get("time_split") or {}
        time_text = "–"
        if split:
            time_text = " · ".join(
                _fmt(split.get(k) and split[k] * 100, ".1f", "%")
                for k in ("frac_draft_forward", "frac_target_forward", "frac_engine")
            )
        lines.append(
            f"| `{row['strategy']}` | {row['identical_text']} | {_fmt(row['tokens_per_s_median'])} "
            f"| {_fmt(speedup['median'], '.2f', '×')} "
            f"| {_fmt(speedup['min'])}–{_fmt(speedup['max'])} ({_fmt(speedup['q1'])}–{_fmt(speedup['q3'])}) "
            f"| {_fmt(row['tokens_per_target_step'])} | {_fmt(row['draft_passes_per_token'])} | {time_text} "
            f"| {_fmt(split.get('engine_ms_per_step'), '.1f')} | {_fmt(row['peak_rss_mib'], '.0f')} |"
        )
    return "\n".join(lines)


TABLE_NOTES = (
    "Identical to plain (greedy): prompts whose output equals plain generate's token for token; \"at a near-tie\" "
    "counts prompts that first left plain where plain's own pass put the two best logits within two rounding steps "
    "of the model's dtype (bfloat16 tree passes round differently from one-token passes; results.json has each "
    "difference's position and margin). "
    "Speedup: per prompt, plain's seconds per new token over the strategy's, then the median over prompts "
    "(min–max and interquartile range beside it). Tokens / target step: new tokens per target pass that emits "
    "tokens (hf_specdec's separate prompt-prefill pass is not a step; in Transformers' loops every pass is). "
    "Passes are counted by forward hooks on the models, so Transformers' own options are counted the same way. "
    "Time split (hf_specdec only): share of the loop's time inside draft-model passes, target passes, and the "
    "engine's own Python/tensor work outside any model pass (the remainder is the prompt prefill). "
    "Peak RSS: resident-memory high-water during the call minus before it."
)


def markdown(results: dict[str, Any], plot_links: dict[str, str] | None = None) -> str:
    """The results as markdown: machine and settings lines, the table, its notes, then the plots."""
    parts = [machine_line(results), "", settings_line(results), "", markdown_table(results["summary"]), "",
             TABLE_NOTES]
    if plot_links:
        parts += ["", " ".join(f"![{name}]({link})" for name, link in plot_links.items())]
    return "\n".join(parts) + "\n"


# --- plots ------------------------------------------------------------------------------------------------------


def _figure(rows: int) -> tuple[Figure, Any]:
    figure = Figure(figsize=(max(8.0, 0.9 * rows + 2.5), 5.2), layout="constrained")
    return figure, figure.add_subplot()


def plot_speedup(results: dict[str, Any], path: Path) -> Path:
    """Median speedup per strategy; thin whiskers min–max, thick bar IQR."""
    summary = results["summary"]
    figure, axes = _figure(len(summary))
    x = range(len(summary))
    medians = [row["speedup"]["median"] or 0.0 for row in summary]
    axes.bar(x, medians, color="#9bb7d4", edgecolor="#2f4b66")
    for i, row in enumerate(summary):
        s = row["speedup"]
        if s["median"] is None:
            continue
        axes.vlines(i, s["min"], s["max"], color="black", linewidth=1)
        axes.vlines(i, s["q1"], s["q3"], color="black", linewidth=4)
        axes.annotate(f"{s['median']:.2f}×", (i, s["max"]), textcoords="offset points", xytext=(0, 4),
                      ha="center", fontsize=8)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xticks(list(x), [row["strategy"] for row in summary], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("speedup over plain generate (×)")
    axes.set_title("Speedup per strategy: median over prompts (IQR thick, min–max thin)\n" + caption(results),
                   fontsize=9)
    figure.savefig(path, dpi=110)
    return path


def plot_tokens_per_step(results: dict[str, Any], path: Path) -> Path:
    summary = [row for row in results["summary"] if row["kind"] != "reference"]  # llama.cpp has no target steps
    figure, axes = _figure(len(summary))
    values = [row["tokens_per_target_step"] or 0.0 for row in summary]
    axes.bar(range(len(summary)), values, color="#b9d49b", edgecolor="#4b662f")
    for i, value in enumerate(values):
        axes.annotate(f"{value:.2f}", (i, value), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    axes.set_xticks(list(range(len(summary))), [row["strategy"] for row in summary], rotation=30, ha="right",
                    fontsize=8)
    axes.set_ylabel("new tokens per target step")
    axes.set_title("Tokens per target forward step\n" + caption(results), fontsize=9)
    figure.savefig(path, dpi=110)
    return path


def plot_time_split(results: dict[str, Any], path: Path) -> Path | None:
    """Stacked shares of hf_specdec's loop time: prefill, draft passes, target passes, engine overhead."""
    rows = [row for row in results["summary"] if row.get("time_split")]
    if not rows:
        return None
    figure, axes = _figure(len(rows))
    parts = [("frac_prefill", "prefill", "#cccccc"), ("frac_draft_forward", "draft passes", "#9bb7d4"),
             ("frac_target_forward", "target passes", "#b9d49b"), ("frac_engine", "engine overhead", "#e0a96d")]
    bottom = [0.0] * len(rows)
    for key, label, color in parts:
        values = [(row["time_split"].get(key) or 0.0) * 100 for row in rows]
        axes.bar(range(len(rows)), values, bottom=bottom, label=label, color=color, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, values)]
    axes.set_xticks(list(range(len(rows))), [row["strategy"] for row in rows], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("share of generate time (%)")
    axes.set_ylim(0, 105)
    axes.legend(fontsize=8, loc="lower right")
    axes.set_title("Where hf_specdec's time goes\n" + caption(results), fontsize=9)
    figure.savefig(path, dpi=110)
    return path


def budget_sweeps(summary: list[dict[str, Any]]) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """Series of one method run at several `budget`s (other settings equal): name -> [(budget, row)], sorted."""
    series: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for row in summary:
        settings = dict(row.get("settings") or {})
        budget = settings.pop("budget", None)
        if row["kind"] != "hf_specdec" or not isinstance(budget, (int, float)):
            continue
        others = ",".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in sorted(settings.items()))
        series[row["name"] + (f" ({others})" if others else "")].append((budget, row))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()
            if len({b for b, _ in points}) >= 2}


def plot_budget(results: dict[str, Any], path: Path) -> Path | None:
    sweeps = budget_sweeps(results["summary"])
    if not sweeps:
        return None
    figure = Figure(figsize=(8.0, 5.2), layout="constrained")
    axes = figure.add_subplot()
    for name, points in sweeps.items():
        budgets = [b for b, _ in points]
        medians = [row["speedup"]["median"] for _, row in points]
        low = [m - row["speedup"]["q1"] for m, (_, row) in zip(medians, points)]
        high = [row["speedup"]["q3"] - m for m, (_, row) in zip(medians, points)]
        axes.errorbar(budgets, medians, yerr=[low, high], marker="o", capsize=3, label=name)
    axes.set_xscale("log", base=2)
    ticks = sorted({b for points in sweeps.values() for b, _ in points})
    axes.set_xticks(ticks, [f"{b:g}" for b in ticks])
    axes.minorticks_off()
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xlabel("tree budget (nodes, root included)")
    axes.set_ylabel("speedup over plain generate (×, median, IQR bars)")
    axes.legend(fontsize=8)
    axes.set_title("Speedup against tree budget\n" + caption(results), fontsize=9)
    figure.savefig(path, dpi=110)
    return path


def write_plots(results: dict[str, Any], folder: str | Path) -> dict[str, Path]:
    """Every plot that applies to these results, as {kind: path}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {
        "speedup": plot_speedup(results, folder / PLOTS["speedup"]),
        "tokens_per_step": plot_tokens_per_step(results, folder / PLOTS["tokens_per_step"]),
        "time_split": plot_time_split(results, folder / PLOTS["time_split"]),
        "budget": plot_budget(results, folder / PLOTS["budget"]),
    }
    return {kind: path for kind, path in written.items() if path is not None}


def write_report(results: dict[str, Any], folder: str | Path, with_json: bool = True) -> dict[str, Path]:
    """results.json (unless redrawing from it), plots and results.md linking the plots into `folder`."""
    folder = Path(folder)
    paths = {"json": write_json(results, folder / RESULTS_JSON)} if with_json else {}
    plots = write_plots(results, folder)
    paths.update(plots)
    md = folder / RESULTS_MD
    md.write_text(markdown(results, {kind: path.name for kind, path in plots.items()}), encoding="utf-8")
    paths["markdown"] = md
    return paths
