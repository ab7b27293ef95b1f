"""PNG plots of a Sequoia plan: what was measured, what the planner predicted, and the tree it chose."""

from __future__ import annotations

from pathlib import Path

from hf_specdec.methods.sequoia.dp import TreePlanner
from hf_specdec.methods.sequoia.plan_file import SequoiaPlan


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _caption(plan: SequoiaPlan) -> str:
    env, profile = plan.environment, plan.profile
    where = f"{profile.dtype} on {profile.device}{' (offloaded)' if profile.offloaded else ''}" if profile else ""
    mode = "greedy" if plan.temperature <= 0 else f"T={plan.temperature:g}"
    models = f"{Path(plan.target.get('name', '?')).name} ← {Path(plan.draft.get('name', '?')).name}"
    return f"{models}, {where}, {mode}, {env.get('processor', '')}"


def plot_acceptance(plan: SequoiaPlan, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ranks = list(range(1, len(plan.acceptance) + 1))
    ax.bar(ranks, plan.acceptance, color="tab:blue")
    ax.set_xlabel("rank of the drafted child (drafting order)")
    ax.set_ylabel("P(this child is the accepted one)")
    ax.set_title(f"Acceptance vector ({plan.acceptance_positions} positions, verifier {plan.verifier})", fontsize=10)
    ax.set_xticks(ranks)
    fig.text(0.01, 0.01, _caption(plan), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_expected_tokens(plan: SequoiaPlan, path: Path, max_budget: int = 128, depths=(2, 3, 4, 6, 8, 12)) -> Path:
    plt = _pyplot()
    depths = [d for d in depths if d <= plan.tree.max_depth] or [plan.tree.max_depth]
    table = TreePlanner(plan.acceptance, max_budget, max(depths)).table
    fig, ax = plt.subplots(figsize=(7, 4))
    budgets = range(1, max_budget + 1)
    for d in depths:
        ax.plot(budgets, [table[n, d] for n in budgets], label=f"depth ≤ {d}")
    ax.axvline(len(plan.parents), color="grey", linestyle=":", label=f"chosen: {len(plan.parents)} nodes")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (nodes, root included)")
    ax.set_ylabel("expected tokens per target step")
    ax.set_title("Sequoia: best expected tokens for each budget and depth", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, _caption(plan), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_time_per_token(plan: SequoiaPlan, path: Path) -> Path:
    """Predicted vs measured seconds per token for every tree that was decoded on held-out prompts."""
    plt = _pyplot()
    rows = plan.measured.get("trees", [])
    fig, ax = plt.subplots(figsize=(5.5, 5))
    if rows:
        predicted = [r["predicted_seconds_per_token"] * 1000 for r in rows]
        measured = [r["measured_seconds_per_token"] * 1000 for r in rows]
        ax.scatter(predicted, measured, color="tab:orange")
        for r, x, y in zip(rows, predicted, measured):
            label = f"n={r['nodes']}, d={r['depth']}"
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        low, high = min(predicted + measured) * 0.9, max(predicted + measured) * 1.1
        ax.plot([low, high], [low, high], color="grey", linestyle=":", label="measured = predicted")
        ax.legend(fontsize=8)
    ax.set_xlabel("predicted ms per token")
    ax.set_ylabel("measured ms per token (held-out prompts)")
    ax.set_title("Hardware-aware sizing: prediction vs measurement", fontsize=10)
    fig.text(0.01, 0.01, _caption(plan), fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency(plan: SequoiaPlan, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in (("target", plan.profile.target), ("draft", plan.profile.draft)):
        ax.plot(curve.sizes, [s * 1000 for s in curve.seconds], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"new tokens in one forward pass (after {plan.profile.target.past_length} cached)")
    ax.set_ylabel("ms per pass (median)")
    ax.set_title("Measured forward time against tree size", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, _caption(plan), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tree(plan: SequoiaPlan, path: Path) -> Path:
    """Levels top to bottom, each level's nodes spread evenly; edges to parents; earlier-drafted children left."""
    plt = _pyplot()
    parents = plan.parents
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    levels: dict[int, list[int]] = {}
    for node, depth in enumerate(depths):
        levels.setdefault(depth, []).append(node)
    x = {}
    for nodes in levels.values():
        for i, node in enumerate(nodes):
            x[node] = (i + 1) / (len(nodes) + 1)
    widest = max(len(nodes) for nodes in levels.values())
    fig, ax = plt.subplots(figsize=(min(max(6, widest * 0.35), 16), 1.0 + 0.8 * len(levels)))
    for node in range(1, len(parents)):
        ax.plot([x[parents[node]], x[node]], [-depths[parents[node]], -depths[node]], color="grey", linewidth=0.7)
    ax.scatter([x[n] for n in range(len(parents))], [-d for d in depths], s=18, color="tab:green", zorder=3)
    ax.set_yticks([-d for d in levels], [f"depth {d} ({len(levels[d])})" for d in levels])
    ax.set_xticks([])
    ax.set_title(f"Sequoia tree: {len(parents)} nodes, {plan.tree.expected_tokens:.2f} expected tokens per step",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(plan: SequoiaPlan, folder: str | Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [plot_acceptance(plan, folder / "acceptance.png"),
             plot_expected_tokens(plan, folder / "expected_tokens.png"),
             plot_tree(plan, folder / "tree.png")]
    if plan.profile is not None:
        paths.append(plot_latency(plan, folder / "latency.png"))
    if plan.measured.get("trees"):
        paths.append(plot_time_per_token(plan, folder / "time_per_token.png"))
    return paths
