"""Static tree shapes in the parents format shared by the whole package, and the acceptance vector that ranks
their children.

A shape is a list `parents` with `parents[0] == -1` (node 0 is the root, the last accepted token) and
`parents[i] < i` for every drafted node i. Nodes are breadth-first (depths never decrease) and the children
of a node are contiguous, in drafting order: the first-drafted child comes first and takes acceptance rank 1.
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_parents(depth: int) -> list[int]:
    """A chain of `depth` drafted tokens (depth + 1 nodes): plain speculative decoding."""
    if int(depth) != depth or depth < 0:
        raise ValueError(f"A chain needs a non-negative number of drafted tokens, got depth={depth!r}.")
    return [-1] + list(range(int(depth)))


def widths_parents(widths: Sequence[int]) -> list[int]:
    """A uniform tree: every node at level i (root = level 0) has `widths[i]` children.

    `widths=[4, 2, 1]` gives 1 + 4 + 8 + 8 = 21 nodes: the root has 4 children, each of those 2, each of those 1.
    """
    widths = list(widths)
    bad = [w for w in widths if isinstance(w, bool) or int(w) != w or w < 1]
    if bad:
        raise ValueError(f"Tree widths must be positive integers (children per node, one per level), got {widths!r}.")
    parents, level = [-1], [0]
    for w in widths:
        next_level = []
        for node in level:
            for _ in range(int(w)):
                parents.append(node)
                next_level.append(len(parents) - 1)
        level = next_level
    return parents


def validate_parents(parents: Sequence[int]) -> None:
    """Raise ValueError unless `parents` is a breadth-first tree with contiguous sibling groups."""
    parents = list(parents)
    if not parents or parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {parents[:1]!r}: start the list with -1.")
    depths, has_children = [0], set()
    for i in range(1, len(parents)):
        p = parents[i]
        if isinstance(p, bool) or int(p) != p or not 0 <= p < i:
            raise ValueError(
                f"parents[{i}] = {p!r}: every non-root node needs a parent index in [0, {i}) (parents come first)."
            )
        p = int(p)
        depths.append(depths[p] + 1)
        if depths[i] < depths[i - 1]:
            raise ValueError(
                f"Node {i} (depth {depths[i]}) follows node {i - 1} (depth {depths[i - 1]}): list nodes breadth-first, "
                f"level by level."
            )
        if p != parents[i - 1] and p in has_children:
            raise ValueError(
                f"Node {i} is a child of node {p}, but node {p}'s other children are not right before it: list each "
                f"node's children contiguously, in drafting order."
            )
        has_children.add(p)


def validate_acceptance(acceptance: Sequence[float]) -> list[float]:
    """Check an acceptance vector and return it as a list of floats."""
    p = [float(x) for x in acceptance]
    if not p:
        raise ValueError("The acceptance vector is empty: give at least one probability, e.g. [0.6, 0.2, 0.1].")
    bad = [x for x in p if not 0.0 <= x <= 1.0]  # also catches NaN
    if bad:
        raise ValueError(f"Acceptance probabilities must lie in [0, 1], got {bad}: fix or drop those entries.")
    if sum(p) > 1.0 + 1e-6:
        raise ValueError(
            f"Acceptance probabilities are exclusive events (at most one child is accepted), so they must sum "
            f"to at most 1, but they sum to {sum(p):.6g}: renormalise them or drop the tail."
        )
    return p
