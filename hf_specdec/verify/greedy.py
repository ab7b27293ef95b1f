"""Greedy verification: follow the target's argmax down the tree, decided on the target's device in one read."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..core.tree import HostTree, TokenTree
from ..core.wide_rows import row_argmax
from .registry import register_verifier
from .tree_walk import Verdict


@register_verifier
class GreedyVerifier:
    """Accept the longest path whose every token equals the target's argmax at its parent."""

    name: ClassVar[str] = "greedy"
    child_selection: ClassVar[str] = "top_k"

    def verify(self, tree: TokenTree, target_scores: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        return self.verify_rows([tree], [target_scores])[0]

    def verify_rows(self, trees: list[TokenTree], target_scores: list[torch.Tensor],
                    generator: torch.Generator | None = None) -> list[Verdict]:
        """The verdicts of several trees (a batch's rows), decided on the target's device and read in one transfer:
        per tree what is accepted, the argmax, and the tokens the host lacks (each padded to the largest tree)."""
        width = max(len(tree) for tree in trees)
        lacking = [tree.host().tokens is None for tree in trees]
        decided = []
        for tree, scores, lacks in zip(trees, target_scores, lacking):
            best, accepted = accepted_nodes(tree, scores)
            rows = [accepted.long(), best, *([tree.tokens.to(best.device)] if lacks else [])]
            decided.append(torch.nn.functional.pad(torch.stack(rows), (0, width - len(tree))).flatten())
        flat = torch.cat(decided).tolist()  # the one read
        verdicts, at = [], 0
        for tree, lacks in zip(trees, lacking):
            host, n = tree.host(), len(tree)
            accepted, best = flat[at : at + n], flat[at + width : at + width + n]
            if lacks:
                host.tokens = flat[at + 2 * width : at + 2 * width + n]
            at += (3 if lacks else 2) * width
            path = [node for node, ok in enumerate(accepted) if ok]  # a chain from the root: BFS order, root first
            verdicts.append(Verdict(path=path, bonus_token=best[path[-1]], accepted_ranks=_ranks(host, path)))
        return verdicts


def accepted_nodes(tree: TokenTree, target_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax `(n,)` of every node and which nodes the greedy walk accepts `(n,)` bool, on the scores' device.

    A node is accepted when it and each of its ancestors carry their parent's argmax; among siblings repeating a
    token only the first-drafted one counts (the walk tries children in drafting order), so the accepted nodes form
    one path from the root.
    """
    device = target_scores.device
    best = row_argmax(target_scores)
    parents, tokens = tree.parents.to(device), tree.tokens.to(device)
    n = len(tree)
    index = torch.arange(n, device=device)
    match = torch.ones(n, dtype=torch.bool, device=device)
    if n > 1:
        hit = tokens[1:] == best[parents[1:]]
        first = torch.full((n,), n, device=device).scatter_reduce(0, parents[1:], torch.where(hit, index[1:], n),
                                                                  "amin")
        match[1:] = hit & (first[parents[1:]] == index[1:])
    accepted = ~(tree.ancestors.to(device) & ~match).any(dim=-1)
    return best, accepted


def _ranks(host: HostTree, path: list[int]) -> list[int]:
    """Each accepted node's rank among its siblings (0 = drafted first)."""
    children = host.children()
    return [children[parent].index(child) for parent, child in zip(path, path[1:])]
