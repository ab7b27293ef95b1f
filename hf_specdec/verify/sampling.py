"""Exact sampling verifiers: what they emit is distributed exactly as sampling from the target alone.

Each walks down from the root on the target's device (`walk.py`), touching only the nodes it visits. At a node the
target distribution is `p = softmax(target_scores[node])` (scores already processed: temperature, top-k, top-p...),
and for the residual verifiers the draft distribution its children were drawn from is `q = tree.draft_probs[node]`.
Random draws go through a small `RandomSource` so tests can enumerate every branch of the real code.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..core.tree import TokenTree
from ..core.verdict import Verifier
from .random_source import RandomSource, TorchRandom
from .registry import register_verifier
from .tree_walk import Verdict, reads_per_level
from .walk import ResidualWalk, TargetWalk, Walk

__all__ = ["RandomSource", "SequoiaVerifier", "SpecInferVerifier", "TargetSampleVerifier", "TorchRandom"]


class _WalkingVerifier(Verifier):
    """A verifier deciding by a walk on the target's device (`walk.py`): one processed row and two draws per level."""

    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)
    #: Read after every level and stop where the walk ends (True), or run every level and read once (False). None:
    #: the former on CPU, where a read waits for nothing while a level past the walk's end costs a row's processing.
    stop_early: ClassVar[bool | None] = None

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        stop_early = reads_per_level(self.stop_early, target_scores.device)
        return self.walk(tree, target_scores.device).run(target_scores, source or TorchRandom(generator), stop_early)

    def walk(self, tree: TokenTree, device: torch.device) -> Walk:
        raise NotImplementedError


class _ResidualVerifier(_WalkingVerifier):
    """Recursive rejection sampling (`ResidualWalk`); subclasses say how the drafter drew the children."""

    without_replacement: ClassVar[bool]

    def walk(self, tree: TokenTree, device: torch.device) -> Walk:
        return ResidualWalk(tree, device, self.without_replacement)


@register_verifier
class SequoiaVerifier(_ResidualVerifier):
    """Exact for children drawn without replacement from q (Sequoia / SpecTr-style recursive rejection)."""

    name: ClassVar[str] = "sequoia"
    child_selection: ClassVar[str] = "without_replacement"
    without_replacement: ClassVar[bool] = True


@register_verifier
class SpecInferVerifier(_ResidualVerifier):
    """Exact for children drawn i.i.d. from q (SpecInfer's multi-step speculative sampling)."""

    name: ClassVar[str] = "specinfer"
    child_selection: ClassVar[str] = "with_replacement"
    without_replacement: ClassVar[bool] = False


@register_verifier
class TargetSampleVerifier(_WalkingVerifier):
    """Sample from the target at each node and descend while a child carries the sample.

    Exact for any tree whose shape and tokens do not depend on the target's randomness (top-k, best-first,
    n-gram drafts): the emitted tokens are literally target samples; the tree only decides how many per step.
    """

    name: ClassVar[str] = "target_sample"
    child_selection: ClassVar[str] = "top_k"

    def walk(self, tree: TokenTree, device: torch.device) -> Walk:
        return TargetWalk(tree, device)
