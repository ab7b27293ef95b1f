"""The verifier contract: what verification returns (Verdict) and what a verifier is (Verifier)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
        tokens: the tokens the step emits for it (the accepted drafted ones, then the bonus), once the step has
            them (`decoding.step.judge`): a drafter that never read its tree's tokens learns them from here.
    """

    path: list[int]
    bonus_token: int
    accepted_ranks: list[int]
    tokens: list[int] | None = None


class Verifier:
    """Decides which drafted tokens the target keeps.

    `child_selection` tells drafters how children must be drawn for this verifier to stay exact:
    "top_k" (deterministic, most probable first), "without_replacement" or "with_replacement"
    (sampled from the draft distribution recorded in `tree.draft_probs`).
    """

    name: ClassVar[str]
    child_selection: ClassVar[str]
    #: reads the target scores of the nodes it visits only: the loop hands it `logits.processing.NodeScores`, which
    #: processes a node's row when it is first indexed (the sampling verifiers); False: every node's row, processed
    walks: ClassVar[bool] = False

    def verify(self, tree: TokenTree, target_scores: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
        """`target_scores` are `(n, vocab)` float32 processed scores (logits processors applied per node). A verifier
        with `walks = True` (it reads only the nodes it visits) gets them as `logits.processing.NodeScores`, which
        processes a node's row when it is first indexed."""
        raise NotImplementedError

    def verify_rows(self, trees: list[TokenTree], target_scores: list, generator: torch.Generator | None = None,
                    source: object | None = None) -> list[Verdict]:
        """Every row's verdict of a batch step. By default row by row, the rows drawing one after another from one
        generator (or from `source`, a scripted random source the exactness tests enumerate outcomes with); a
        verifier that can decide them together (greedy: one read) overrides it."""
        draws = {"generator": generator} if source is None else {"source": source}
        return [self.verify(tree, scores, **draws) for tree, scores in zip(trees, target_scores)]
