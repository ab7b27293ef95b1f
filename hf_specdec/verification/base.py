"""What every verifier does: walk the drafted tree with the target's scores, return what is accepted."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from ..core.tree import TokenTree
from ..core.verdict import Verdict


def walk_down(tree: TokenTree, choose) -> Generator[Any, Any, Verdict]:
    """Descend from the root: `choose(node, children)`, a generator that yields the random decisions it needs and
    receives their outcomes (see `sampling.RandomSource`), returns (child index or None, token if stopping); a child
    with a token descends there and stops (a leaf whose bonus token was drawn with its parent's decision). A
    generator itself, so that several trees (a batch's rows) can walk in lockstep with their decisions read
    together (`sampling.run_walks`); its return value is the verdict."""
    children_of = tree.host().children()
    node, path, ranks = 0, [0], []
    while True:
        children = children_of[node]
        picked, token = yield from choose(node, children)
        if picked is None:
            return Verdict(path=path, bonus_token=token, accepted_ranks=ranks)
        ranks.append(children.index(picked))
        path.append(picked)
        if token is not None:
            return Verdict(path=path, bonus_token=token, accepted_ranks=ranks)
        node = picked
