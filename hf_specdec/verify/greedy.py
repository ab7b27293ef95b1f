"""Greedy verification: follow the target's argmax down the tree: the argmax on the target's device, read once, the
walk on the host."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..core.tree import TokenTree
from ..core.wide_rows import row_argmax
from .registry import register_verifier
from .tree_walk import Verdict, walk_down


@register_verifier
class GreedyVerifier:
    """Accept the longest path whose every token equals the target's argmax at its parent."""

    name: ClassVar[str] = "greedy"
    child_selection: ClassVar[str] = "top_k"

    def verify(self, tree: TokenTree, target_scores: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        return self.verify_rows([tree], [target_scores])[0]

    def verify_rows(self, trees: list[TokenTree], target_scores: list[torch.Tensor],
                    generator: torch.Generator | None = None) -> list[Verdict]:
        """The verdicts of several trees (a batch's rows): each node's argmax computed on the target's device and
        read in one transfer (with the tokens a host copy lacks), then the walk down each tree on the host."""
        lacking = [tree.host().tokens is None for tree in trees]
        rows = []
        for tree, scores, lacks in zip(trees, target_scores, lacking):
            best = row_argmax(scores)
            rows.append(torch.cat([best, tree.tokens.to(best.device)]) if lacks else best)
        flat = (torch.cat(rows) if len(rows) > 1 else rows[0]).tolist()  # the one read
        verdicts, at = [], 0
        for tree, lacks in zip(trees, lacking):
            host, n = tree.host(), len(tree)
            best = flat[at : at + n]
            if lacks:
                host.tokens = flat[at + n : at + 2 * n]
            at += (2 if lacks else 1) * n
            verdicts.append(walk_down(tree, _argmax_child(host.tokens, best)))
        return verdicts


def _argmax_child(tokens: list[int], best: list[int]):
    """`walk_down`'s choice: the first-drafted child carrying its parent's argmax (a later sibling repeating the
    token is never tried); where none does, the walk stops with that argmax as the bonus token."""
    def choose(node: int, children: list[int]) -> tuple[int | None, int | None]:
        child = next((child for child in children if tokens[child] == best[node]), None)
        return (child, None) if child is not None else (None, best[node])
    return choose
