"""The verifier contract: what verification returns (Verdict) and what a verifier is (Verifier)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .tree import TokenTree


@dataclass
class Verdict:
    """Outcome of verifying one tree.

    Attributes:
        path: node indices from the root (0) to the deepest accepted node.
        bonus_token: the token the target emits after the accepted path (a correction or a free extra).
        accepted_ranks: for each accepted drafted node, its rank among its siblings (0 = drafted first);
            the Sequoia planner learns its acceptance vector from these.
    """

    path: list[int]
    bonus_token: int
    accepted_ranks: list[int]


class Verifier(Protocol):
    """Decides which drafted tokens the target keeps.

    `child_selection` tells drafters how children must be drawn for this verifier to stay exact:
    "top_k" (deterministic, most probable first), "without_replacement" or "with_replacement"
    (sampled from the draft distribution recorded in `tree.draft_probs`).
    """

    name: ClassVar[str]
    child_selection: ClassVar[str]

    def verify(self, tree: TokenTree, target_scores: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        """`target_scores` are `(n, vocab)` float32 processed scores (logits processors applied per node). A verifier
        with `walks = True` (it reads only the nodes it visits) gets them as `core.processing.NodeScores`, which
        processes a node's row when it is first indexed."""
        ...
