"""Exact sampling verifiers: what they emit is distributed exactly as sampling from the target alone.

Each walks down from the root, touching only the nodes it visits. At a node the target distribution is
`p = softmax(target_scores[node])` (scores already processed: temperature, top-k, top-p...), and for the
residual verifiers the draft distribution its children were drawn from is `q = tree.draft_probs[node]`.
Random draws go through a small `RandomSource` so tests can enumerate every branch of the real code;
the default one uses a `torch.Generator` (or the global RNG), so seeded runs reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch

from ..core.tree import TokenTree
from .registry import register_verifier
from .tree_walk import Verdict, walk_down


class RandomSource(Protocol):
    """The random decisions a verifier makes, one call per visited node."""

    def decide(self, accept: torch.Tensor | None, dists: list[torch.Tensor]) -> tuple[int | None, Sequence[int]]:
        """Trials `i = 0..k-1`, each succeeding with probability `accept[i]` `(k,)`: the first that succeeds (None:
        none does, or no trials); and a token drawn from each normalized distribution in `dists` `(V,)`, of which
        the verifier uses at most one. Everything is drawn independently, so the unused draws change nothing."""
        ...


class TorchRandom:
    """`RandomSource` on a `torch.Generator` (None: torch's global RNG), drawing on the generator's device and
    reading every outcome of a node in one transfer."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def decide(self, accept: torch.Tensor | None, dists: list[torch.Tensor]) -> tuple[int | None, list[int]]:
        device = accept.device if accept is not None else dists[0].device
        where = self.generator.device if self.generator is not None else device  # no generator: that device's RNG
        drawn = [torch.multinomial(d.to(where), 1, generator=self.generator).to(device) for d in dists]
        if accept is None:
            return None, torch.cat(drawn).tolist()
        k = len(accept)
        uniforms = torch.rand(k, dtype=accept.dtype, generator=self.generator, device=where).to(device)
        first = torch.where(uniforms < accept, torch.arange(k, device=device), k).amin(0, keepdim=True)
        rank, *tokens = torch.cat([first, *drawn]).tolist()
        return (rank if rank < k else None), tokens


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _normalized(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """`r / r.sum()`, or `fallback` where r has no mass, decided on r's device (no read)."""
    mass = r.sum()
    return torch.where(mass > 0, r / mass, fallback)


def _without(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.index_fill(0, x, 0)


def _target_dists(target_scores: torch.Tensor, nodes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The target's distributions at `nodes`: a visited node's children that are leaves get their bonus token drawn
    with the node's own decision (one read per visited node with children, none for the leaf the walk ends on)."""
    return [target_scores[node].to(dtype).softmax(-1) for node in nodes]


def _trials(p: torch.Tensor, q: torch.Tensor, xs: torch.Tensor, without_replacement: bool):
    """The children `xs` tried in order: each one's acceptance probability `(k,)`, and the target's residual after
    rejecting them all, on p's device.

    Accept child x with min(1, p[x] / q[x]); on a rejection p <- norm(max(p - q, 0)), the target conditioned on
    "not this proposal" (p without x where that has no mass: then p == q and rejecting had probability 0, float
    noise); children drawn without replacement also drop x from q, since the next child was drawn from q without x.
    A child q could not have proposed (q[x] = 0) carries no information: it is never accepted and changes nothing.
    """
    accept = torch.zeros(len(xs), dtype=p.dtype, device=p.device)
    for i in range(len(xs)):
        x = xs[i : i + 1]
        px, qx = p[x], q[x]
        proposable = qx > 0
        accept[i : i + 1] = torch.where(proposable, (px / qx).clamp(max=1.0), 0.0)
        rejected = _normalized((p - q).clamp(min=0), fallback=_normalized(_without(p, x), p))
        p = torch.where(proposable, rejected, p)
        if without_replacement:
            q = torch.where(proposable, _normalized(_without(q, x), q), q)
    return accept, p


def _residual_verify(
    tree: TokenTree, target_scores: torch.Tensor, source: RandomSource, without_replacement: bool
) -> Verdict:
    """Recursive rejection sampling (SpecInfer; Sequoia/SpecTr when `without_replacement`).

    At each visited node the children's trials (`_trials`) run on the target's device and the source reads the
    outcome once: the first accepted child, where the walk descends, or a token from the residual. Nothing
    drafted below a node: sample from p.
    """
    tokens = tree.host(tokens=True).tokens
    dtype = _work_dtype(target_scores.device)
    children_of = tree.host().children()

    def choose(node: int, children: list[int]):
        p = target_scores[node].to(dtype).softmax(-1)
        if not children:  # a root with nothing drafted below it
            return None, source.decide(None, [p])[1][0]
        if tree.draft_probs is None:
            raise ValueError("Sampling verifiers need `tree.draft_probs` (the draft distribution at each node).")
        q = tree.draft_probs[node].to(device=p.device, dtype=dtype)
        if len(q) != len(p):  # draft and target vocabularies may be padded differently
            size = max(len(p), len(q))
            p, q = (torch.nn.functional.pad(t, (0, size - len(t))) for t in (p, q))
        q = _normalized(q, fallback=q)  # an all-zero row proposes nothing: every child is skipped
        xs = torch.tensor([tokens[child] for child in children]).to(p.device)
        accept, residual = _trials(p, q, xs, without_replacement)
        leaves = [child for child in children if not children_of[child]]
        rank, drawn = source.decide(accept, [residual, *_target_dists(target_scores, leaves, dtype)])
        if rank is None:
            return None, drawn[0]
        child = children[rank]
        return child, (drawn[1 + leaves.index(child)] if child in leaves else None)

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
        children_of = tree.host().children()

        def choose(node: int, children: list[int]):
            leaves = [child for child in children if not children_of[child]]
            _, drawn = source.decide(None, _target_dists(target_scores, [node, *leaves], dtype))
            for child in children:
                if tokens[child] == drawn[0]:
                    return child, (drawn[1 + leaves.index(child)] if child in leaves else None)
            return None, drawn[0]

        return walk_down(tree, choose)
