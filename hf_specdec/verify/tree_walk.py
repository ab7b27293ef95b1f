"""What every verifier does: walk the drafted tree with the target's scores, return what is accepted."""

from __future__ import annotations

import torch

from ..core.tree import TokenTree
from ..core.verdict import Verdict


def reads_per_level(stop_early: bool | None, device: torch.device) -> bool:
    """A `stop_early` setting resolved (a verifier's; a sized drafter's): read after each level of the walk, or of
    the drafting (True), or once (False). None means on a CPU, where a read waits for nothing and a row not needed is
    work saved."""
    return stop_early if stop_early is not None else device.type == "cpu"


def walk_down(tree: TokenTree, choose) -> Verdict:
    """Descend from the root: `choose(node, children)` returns (child index or None, token if stopping); a child
    with a token descends there and stops (a leaf whose bonus token was drawn with its parent's decision)."""
    children_of = tree.host().children()
    node, path, ranks = 0, [0], []
    while True:
        children = children_of[node]
        picked, token = choose(node, children)
        if picked is None:
            return Verdict(path=path, bonus_token=token, accepted_ranks=ranks)
        ranks.append(children.index(picked))
        path.append(picked)
        if token is not None:
            return Verdict(path=path, bonus_token=token, accepted_ranks=ranks)
        node = picked
