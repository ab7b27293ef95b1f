"""Several cheap drafters at one level of a staged stack: the union of their trees."""

from __future__ import annotations

import torch

from ...core.drafter import Drafter
from ...core.tree import TokenTree


class MergedDrafter(Drafter):
    """Several cheap drafters at one level of a stack: the union of their trees (earlier drafters' nodes first)."""

    def __init__(self, drafters: list[Drafter], max_nodes: int = 32) -> None:
        self.drafters, self.max_nodes = drafters, max_nodes

    @property
    def num_drafting_tokens(self) -> int:
        return max(drafter.num_drafting_tokens for drafter in self.drafters)

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        return self.propose_ids(input_ids[0].tolist())

    def use_window(self, tokens: int | None) -> None:
        for drafter in self.drafters:
            drafter.use_window(tokens)

    def propose_ids(self, ids: list[int]) -> TokenTree:
        paths: list[tuple[int, ...]] = []
        for drafter in self.drafters:
            tree = drafter.propose_ids(ids)
            tokens = tree.host(tokens=True).tokens
            paths += [tuple(tokens[i] for i in tree.path_to(node)[1:]) for node in range(1, len(tree))]
        unique = list(dict.fromkeys(paths))  # keeps every prefix before its extensions, as each tree did
        return TokenTree.from_paths(ids[-1], unique[: self.max_nodes - 1])
