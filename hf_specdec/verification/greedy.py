"""Greedy verification: follow the target's argmax down the tree."""

from __future__ import annotations

from typing import ClassVar

import torch

from ..core.tree import TokenTree
from .base import Verdict, walk_down
from .registry import register_verifier


@register_verifier
class GreedyVerifier:
    """Accept the longest path whose every token equals the target's argmax at its parent."""

    name: ClassVar[str] = "greedy"
    child_selection: ClassVar[str] = "top_k"

    def verify(self, tree: TokenTree, target_scores: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        best = target_scores.argmax(dim=-1).tolist()
        tokens = tree.tokens.tolist()

        def choose(node: int, children: list[int]):
            for child in children:
                if tokens[child] == best[node]:
                    return child, None
            return None, best[node]

        return walk_down(tree, choose)
