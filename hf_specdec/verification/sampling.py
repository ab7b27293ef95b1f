"""Exact sampling verifiers: what they emit is distributed exactly as sampling from the target alone.

Each walks down from the root, touching only the nodes it visits. At a node the target distribution is
`p = softmax(target_scores[node])` (scores already processed: temperature, top-k, top-p...), and for the
residual verifiers the draft distribution its children were drawn from is `q = tree.draft_probs[node]`.
Random draws go through a small `RandomSource` so tests can enumerate every branch of the real code;
the default one uses a `torch.Generator` (or the global RNG), so seeded runs reproduce.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ..core.tree import TokenTree
from .base import Verdict, walk_down
from .registry import register_verifier


class RandomSource(Protocol):
    """The only two random decisions a verifier makes."""

    def accept(self, prob: float) -> bool:
        """True with probability `prob`."""
        ...

    def sample(self, probs: torch.Tensor) -> int:
        """A token drawn from the normalized distribution `probs` `(V,)`."""
        ...


class TorchRandom:
    """`RandomSource` on a `torch.Generator` (None: torch's global RNG)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self.device = generator.device if generator is not None else torch.device("cpu")

    def accept(self, prob: float) -> bool:
        if prob >= 1.0 or prob <= 0.0:  # certain outcomes consume no randomness
            return prob >= 1.0
        return float(torch.rand((), dtype=torch.float64, generator=self.generator, device=self.device)) < prob

    def sample(self, probs: torch.Tensor) -> int:
        if self.generator is not None:
            probs = probs.to(self.generator.device)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _normalized(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    mass = float(r.sum())
    return r / mass if mass > 0 else fallback


def _without(t: torch.Tensor, x: int) -> torch.Tensor:
    return t.index_fill(0, torch.tensor([x], device=t.device), 0)


def _residual_verify(
    tree: TokenTree, target_scores: torch.Tensor, source: RandomSource, without_replacement: bool
) -> Verdict:
    """Recursive rejection sampling (SpecInfer; Sequoia/SpecTr when `without_replacement`).

    Try the children in drafting order: accept child x with min(1, p[x] / q[x]) and descend. On a rejection
    p <- norm(max(p - q, 0)), the target conditioned on "not this proposal"; children drawn without replacement
    also drop x from q, since the next child was drawn from q without x. Nothing accepted: sample from p.
    """
    tokens = tree.host(tokens=True).tokens
    dtype = _work_dtype(target_scores.device)

    def choose(node: int, children: list[int]):
        p = target_scores[node].to(dtype).softmax(-1)
        if children:
            if tree.draft_probs is None:
                raise ValueError("Sampling verifiers need `tree.draft_probs` (the draft distribution at each node).")
            q = tree.draft_probs[node].to(device=p.device, dtype=dtype)
            if len(q) != len(p):  # draft and target vocabularies may be padded differently
                size = max(len(p), len(q))
                p, q = (torch.nn.functional.pad(t, (0, size - len(t))) for t in (p, q))
            q = _normalized(q, fallback=q)  # an all-zero row proposes nothing: every child is skipped
            for child in children:
                x = tokens[child]
                px, qx = torch.stack([p[x], q[x]]).tolist()
                if qx <= 0:  # q could not have proposed x: it carries no information, skip it
                    continue
                if source.accept(min(1.0, px / qx)):
                    return child, None
                residual = torch.clamp(p - q, min=0)
                mass = float(residual.sum())  # zero only if p == q, where rejecting has probability 0 (float noise)
                p = residual / mass if mass > 0 else _normalized(_without(p, x), p)
                if without_replacement:
                    q = _normalized(_without(q, x), q)
        return None, source.sample(p)

    return walk_down(tree, choose)


@register_verifier
class SequoiaVerifier:
    """Exact for children drawn without replacement from q (Sequoia / SpecTr-style recursive rejection)."""

    name: ClassVar[str] = "sequoia"
    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)
    child_selection: ClassVar[str] = "without_replacement"

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        return _residual_verify(tree, target_scores, source or TorchRandom(generator), without_replacement=True)


@register_verifier
class SpecInferVerifier:
    """Exact for children drawn i.i.d. from q (SpecInfer's multi-step speculative sampling)."""

    name: ClassVar[str] = "specinfer"
    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)
    child_selection: ClassVar[str] = "with_replacement"

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        return _residual_verify(tree, target_scores, source or TorchRandom(generator), without_replacement=False)


@register_verifier
class TargetSampleVerifier:
    """Sample from the target at each node and descend while a child carries the sample.

    Exact for any tree whose shape and tokens do not depend on the target's randomness (top-k, best-first,
    n-gram drafts): the emitted tokens are literally target samples; the tree only decides how many per step.
    """

    name: ClassVar[str] = "target_sample"
    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)
    child_selection: ClassVar[str] = "top_k"

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        source = source or TorchRandom(generator)
        tokens = tree.host(tokens=True).tokens
        dtype = _work_dtype(target_scores.device)

        def choose(node: int, children: list[int]):
            x = source.sample(target_scores[node].to(dtype).softmax(-1))
            for child in children:
                if tokens[child] == x:
                    return child, None
            return None, x

        return walk_down(tree, choose)
