"""Greedy verification: follow the target's argmax down the tree. Off the CPU every node's argmax is computed on the
target's device and read once, then walked on the host. On a CPU, where a read waits for nothing, the walk computes
the argmax of the nodes it reaches only (a few of a tree's dozens of vocabulary-wide rows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from ..core.tree import TokenTree
from ..core.verdict import Verifier
from ..logits.wide_rows import row_argmax
from .registry import register_verifier
from .tree_walk import Verdict, reads_per_level, walk_down


@register_verifier
class GreedyVerifier(Verifier):
    """Accept the longest path whose every token equals the target's argmax at its parent."""

    name: ClassVar[str] = "greedy"
    child_selection: ClassVar[str] = "top_k"
    #: argmax the reached nodes only, one read each (None: on a CPU); False: every node's, one read
    stop_early: ClassVar[bool | None] = None

    def verify(self, tree: TokenTree, target_scores: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        if not reads_per_level(self.stop_early, target_scores.device):
            return self.verify_rows([tree], [target_scores])[0]
        host = tree.host()
        if host.tokens is None:
            host.tokens = tree.tokens.tolist()

        def best(node: int) -> int:  # the same argmax as the one-read path, of this node's row only (asked once)
            return int(row_argmax(target_scores[node : node + 1])[0])

        return walk_down(tree, _argmax_child(host.tokens, best))

    def verify_rows(self, trees: list[TokenTree], target_scores: list[torch.Tensor],
                    generator: torch.Generator | None = None, source: object | None = None) -> list[Verdict]:
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


def _argmax_child(tokens: list[int], best: list[int] | Callable[[int], int]):
    """`walk_down`'s choice: the first-drafted child carrying its parent's argmax (`best`: every node's, or a function
    computing a node's); a later sibling repeating the token is never tried; where none does, the walk stops with
    that argmax as the bonus token."""
    argmax = best if callable(best) else best.__getitem__

    def choose(node: int, children: list[int]) -> tuple[int | None, int | None]:
        token = argmax(node)
        child = next((child for child in children if tokens[child] == token), None)
        return (child, None) if child is not None else (None, token)
    return choose
