"""Sequoia planner: optimality against brute force and an independent recursion, shapes, JSON and the CLI."""

from __future__ import annotations

import argparse
import json
from collections import deque
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hf_specdec.methods.sequoia import TreePlan, expected_tokens, expected_tokens_table, plan_tree
from hf_specdec.plan import chain_parents, validate_parents, widths_parents
from hf_specdec_tools.plan_cli import register_cli

# ---------------------------------------------------------------- helpers: nested trees and references


@st.composite
def acceptance_vectors(draw, max_width: int = 4) -> list[float]:
    """Random positional acceptance: exact zeros, non-monotone orders, and a rejection mass that may be 0."""
    width = draw(st.integers(1, max_width))
    raw = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1.0)), min_size=width + 1, max_size=width + 1))
    total = sum(raw)
    return [x / total for x in raw[:width]] if total > 0 else [0.0] * width


def nested_value(tree: tuple, p: list[float]) -> float:
    """E of a nested tree `(child_1, child_2, ...)`, computed top-down without the parents format."""
    return 1.0 + sum((p[r] if r < len(p) else 0.0) * nested_value(child, p) for r, child in enumerate(tree))


def nested_to_parents(tree: tuple) -> list[int]:
    parents, queue = [-1], deque([(0, tree)])
    while queue:
        node, children = queue.popleft()
        for child in children:
            parents.append(node)
            queue.append((len(parents) - 1, child))
    return parents


@lru_cache(None)
def all_trees(size: int, levels: int) -> tuple:
    """Every ordered rooted tree with exactly `size` nodes and at most `levels` levels."""
    if size == 0 or levels == 0:
        return ()
    return tuple(forests(size - 1, levels - 1))


@lru_cache(None)
def forests(size: int, levels: int) -> tuple:
    if size == 0:
        return ((),)
    if levels == 0:
        return ()
    return tuple(
        (first, *rest)
        for s in range(1, size + 1)
        for first in all_trees(s, levels)
        for rest in forests(size - s, levels)
    )


def brute_force_table(p: list[float], n: int, d: int) -> np.ndarray:
    best = np.zeros((n + 1, d + 1))
    for m in range(1, n + 1):
        for lv in range(1, d + 1):
            exact = max((nested_value(t, p) for t in all_trees(m, lv)), default=0.0)
            best[m, lv] = max(exact, best[m - 1, lv], best[m, lv - 1])
    return best


def reference_table(p: list[float], n: int, d: int) -> np.ndarray:
    """Plain memoised recursion of the Sequoia DP, one scalar at a time."""

    @lru_cache(None)
    def f(m: int, levels: int) -> float:
        return 0.0 if m == 0 or levels == 0 else 1.0 + g(m - 1, levels - 1, 1)

    @lru_cache(None)
    def g(k: int, levels: int, rank: int) -> float:
        if k == 0 or levels == 0 or rank > len(p):
            return 0.0
        return max(p[rank - 1] * f(s, levels) + g(k - s, levels, rank + 1) for s in range(1, k + 1))

    return np.array([[f(m, lv) for lv in range(d + 1)] for m in range(n + 1)])


def depth_of(parents: list[int]) -> int:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return max(depths) + 1


def check_plan(plan: TreePlan, p: list[float], n: int, d: int) -> None:
    validate_parents(plan.parents)
    assert len(plan.parents) <= n
    assert depth_of(plan.parents) <= d
    assert expected_tokens(plan.parents, p) == pytest.approx(plan.expected_tokens, rel=1e-9, abs=1e-9)
    assert sum(plan.widths_per_level()) == len(plan.parents)


# ---------------------------------------------------------------- optimality


def test_brute_force_enumeration_is_complete():
    assert [len(all_trees(m, m)) for m in range(1, 9)] == [1, 1, 2, 5, 14, 42, 132, 429]  # Catalan numbers


@settings(max_examples=150, deadline=None)
@given(p=acceptance_vectors(), n=st.integers(1, 8), d=st.integers(1, 8))
def test_matches_brute_force(p, n, d):
    brute = brute_force_table(p, n, d)
    np.testing.assert_allclose(expected_tokens_table(p, n, d), brute, rtol=1e-9, atol=1e-12)
    plan = plan_tree(p, n, d)
    assert plan.expected_tokens == pytest.approx(brute[n, d], rel=1e-9)
    check_plan(plan, p, n, d)


@settings(max_examples=60, deadline=None)
@given(p=acceptance_vectors(max_width=6), n=st.integers(1, 40), d=st.integers(1, 10))
@example(p=[4.3e-38, 1.0], n=4, d=3)  # a gain below float64's resolution next to the total
def test_matches_recursive_reference(p, n, d):
    np.testing.assert_allclose(expected_tokens_table(p, n, d), reference_table(p, n, d), rtol=1e-9, atol=1e-12)
    plan = plan_tree(p, n, d)
    check_plan(plan, p, n, d)
    # Every node earns something, or holds a rank for a later sibling that does.
    probs = [1.0]
    for i in range(1, len(plan.parents)):
        rank = plan.parents[:i].count(plan.parents[i])
        probs.append(probs[plan.parents[i]] * (p[rank] if rank < len(p) else 0.0))
    for i in range(1, len(plan.parents)):
        later = [j for j in range(i + 1, len(plan.parents)) if plan.parents[j] == plan.parents[i]]
        assert probs[i] > 0 or any(probs[j] > 0 for j in later)
    # Positive probabilities use the whole budget when it fits, as long as each node's gain survives rounding next
    # to the total (p = [4e-38, 1.0]: a 4th node adds 4e-38 to 2.0, which float64 cannot tell from nothing).
    if min(p) ** d > 1e-12 and n <= sum(len(p) ** lv for lv in range(d)):
        assert len(plan.parents) == n


@pytest.mark.parametrize("seed", range(4))
def test_matches_recursive_reference_at_size_40(seed):
    rng = np.random.default_rng(seed)
    p = (rng.dirichlet(np.ones(7))[:6] * (rng.random(6) > 0.2)).tolist()  # non-monotone, some exact zeros
    np.testing.assert_allclose(expected_tokens_table(p, 40, 10), reference_table(p, 40, 10), rtol=1e-9, atol=1e-12)
    check_plan(plan_tree(p, 40, 10), p, 40, 10)


def test_expected_tokens_of_nested_trees():
    p = [0.1, 0.6, 0.2]  # non-monotone: rank, not size, decides the probability
    for tree in all_trees(6, 6):
        assert expected_tokens(nested_to_parents(tree), p) == pytest.approx(nested_value(tree, p), rel=1e-12)


def test_known_shapes():
    assert plan_tree([1.0], 10, 4).parents == chain_parents(3)  # certain acceptance: depth is all that counts
    assert plan_tree([1.0], 10, 4).expected_tokens == 4.0
    assert plan_tree([0.0, 0.0], 10, 4).parents == [-1]  # nothing is ever accepted: root alone
    assert plan_tree([0.5], 1, 4).parents == [-1]
    assert plan_tree([0.5], 5, 1).parents == [-1]
    # Non-monotone with a zero rank: the rank-2 child stays as a leaf placeholder so rank 3 keeps p = 0.3.
    plan = plan_tree([0.5, 0.0, 0.3], 4, 2)
    assert plan.parents == [-1, 0, 0, 0]
    assert plan.expected_tokens == pytest.approx(1.8)
    plan = plan_tree([0.2, 0.7], 3, 3)  # the second-drafted child is the likely one: it gets the subtree
    assert plan.expected_tokens == pytest.approx(max(1 + 0.2 + 0.7, 1 + 0.2 + 0.2 * 0.2))


def test_table_monotone_and_consistent():
    p = [0.45, 0.2, 0.1, 0.05]
    table = expected_tokens_table(p, 64, 8)
    assert table.shape == (65, 9)
    assert (table[0] == 0).all() and (table[:, 0] == 0).all() and (table[1, 1:] == 1).all()
    assert (np.diff(table, axis=0) >= -1e-12).all() and (np.diff(table, axis=1) >= -1e-12).all()
    for n, d in [(1, 1), (7, 3), (64, 8), (40, 5)]:
        assert plan_tree(p, n, d).expected_tokens == pytest.approx(table[n, d], rel=1e-12)


def test_large_plan_completes():
    rng = np.random.default_rng(0)
    p = sorted((rng.dirichlet(np.ones(17))[:16]).tolist(), reverse=True)
    plan = plan_tree(p, 256, 16)
    check_plan(plan, p, 256, 16)
    assert len(plan.parents) == 256


@pytest.mark.parametrize(
    "p, n, d, match",
    [([], 8, 4, "empty"), ([0.5, -0.1], 8, 4, r"\[0, 1\]"), ([0.7, 0.6], 8, 4, "sum"), ([float("nan")], 8, 4, "0, 1"),
     ([0.5], 0, 4, "budget"), ([0.5], 8, 0, "max_depth")],
)
def test_invalid_inputs(p, n, d, match):
    with pytest.raises(ValueError, match=match):
        plan_tree(p, n, d)


# ---------------------------------------------------------------- shapes


def test_chain_and_widths():
    assert chain_parents(0) == [-1]
    assert chain_parents(3) == [-1, 0, 1, 2]
    assert widths_parents([]) == [-1]
    assert widths_parents([2, 1]) == [-1, 0, 0, 1, 2]
    parents = widths_parents([4, 2, 1])
    assert len(parents) == 1 + 4 + 8 + 8
    assert parents[:13] == [-1, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    validate_parents(parents)
    assert TreePlan(parents, 0.0, [0.5], 21, 4).widths_per_level() == [1, 4, 8, 8]
    assert expected_tokens(chain_parents(3), [0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    for bad in ([0], [2, -1], [1.5]):
        with pytest.raises(ValueError, match="positive integers"):
            widths_parents(bad)
    with pytest.raises(ValueError):
        chain_parents(-1)


@pytest.mark.parametrize(
    "parents, match",
    [([], "root"), ([0, 0], "root"), ([-1, 1], r"\[0, 1\)"), ([-1, 0, -1], "parent index"),
     ([-1, 0, 1, 0], "breadth-first"), ([-1, 0, 0, 1, 2, 1], "contiguous")],
)
def test_validate_parents_rejects(parents, match):
    with pytest.raises(ValueError, match=match):
        validate_parents(parents)


def test_validate_parents_accepts():
    for parents in ([-1], chain_parents(5), widths_parents([3, 2, 2]), [-1, 0, 0, 2, 2, 1]):
        validate_parents(parents)


# ---------------------------------------------------------------- JSON and CLI


def test_json_round_trip(tmp_path):
    plan = plan_tree([0.6, 0.2, 0.1], 32, 6)
    assert TreePlan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["parents"] == plan.parents
    assert TreePlan.load(path) == plan
    with pytest.raises(ValueError, match="root"):
        TreePlan.from_json(json.dumps({**plan.to_dict(), "parents": [0, 0]}))


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="hf-specdec")
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_json(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    argv = ["plan", "--acceptance", "0.6,0.2,0.1", "--budget", "32", "--max-depth", "6", "--json"]
    assert run_cli(*argv, "--output", str(out_file)) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"expected_tokens", "parents", "budget", "max_depth", "acceptance", "widths_per_level"}
    plan = plan_tree([0.6, 0.2, 0.1], 32, 6)
    assert data["parents"] == plan.parents and data["expected_tokens"] == plan.expected_tokens
    assert (data["budget"], data["max_depth"], data["acceptance"]) == (32, 6, [0.6, 0.2, 0.1])
    assert data["widths_per_level"] == plan.widths_per_level()
    assert TreePlan.load(out_file) == plan


def test_cli_summary_and_errors(capsys):
    assert run_cli("plan", "--acceptance", "0.6,0.2", "--budget", "16", "--max-depth", "4") == 0
    assert "expected tokens per target step" in capsys.readouterr().out
    for argv, match in [
        (["--acceptance", "0.8,0.5", "--budget", "8", "--max-depth", "4"], "sum"),
        (["--acceptance", "1.5", "--budget", "8", "--max-depth", "4"], "[0, 1]"),
        (["--acceptance", "0.5,x", "--budget", "8", "--max-depth", "4"], "comma-separated"),
        (["--acceptance", "0.5", "--budget", "0", "--max-depth", "4"], "--budget"),
        (["--acceptance", "0.5", "--budget", "8", "--max-depth", "0"], "--max-depth"),
    ]:
        assert run_cli("plan", *argv) == 2
        captured = capsys.readouterr()
        assert match in captured.err and captured.out == ""


@settings(max_examples=80, deadline=None)
@given(p=acceptance_vectors(max_width=6), n=st.integers(1, 60), d=st.integers(1, 10))
def test_heap_plan_of_non_increasing_vectors_matches_the_dp(p, n, d):
    """A non-increasing vector takes the heap path; its trees must be exactly as good as the DP's."""
    p = sorted(p, reverse=True)
    plan = plan_tree(p, n, d)
    assert plan.expected_tokens == pytest.approx(reference_table(p, n, d)[n, d], rel=1e-9, abs=1e-12)
    check_plan(plan, p, n, d)


def test_large_non_increasing_plan():
    rng = np.random.default_rng(1)
    p = sorted(rng.dirichlet(np.ones(33))[:32].tolist(), reverse=True)
    plan = plan_tree(p, 1024, 32)
    check_plan(plan, p, 1024, 32)
    assert len(plan.parents) == 1024
