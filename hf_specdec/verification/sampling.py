"""Exact sampling verifiers: what they emit is distributed exactly as sampling from the target alone.

Each walks down from the root, touching only the nodes it visits. At a node the target distribution is
`p = softmax(target_scores[node])` (scores already processed: temperature, top-k, top-p...), and for the
residual verifiers the draft distribution its children were drawn from is `q = tree.draft_probs[node]`.
Random draws go through a small `RandomSource` so tests can enumerate every branch of the real code;
the default one uses a `torch.Generator` (or the global RNG), so seeded runs reproduce.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import ClassVar, Protocol

import torch

from ..core.tree import TokenTree
from .base import Verdict, walk_down
from .registry import register_verifier


class RandomSource(Protocol):
    """The random decisions a verifier makes, one call per visited node."""

    def decide(self, accept: torch.Tensor | None, dists: list[torch.Tensor]) -> tuple[int | None, Sequence[int]]:
        """Trials `i = 0..k-1`, each succeeding with probability `accept[i]` `(k,)`: the first that succeeds (None:
        none does, or no trials); and a token drawn from each normalized distribution in `dists` `(V,)`, of which
        the verifier uses at most one. Everything is drawn independently, so the unused draws change nothing."""
        ...


class TorchRandom:
    """`RandomSource` on a `torch.Generator` (None: torch's global RNG), drawing on the generator's device and
    reading every outcome of a node in one transfer (of several nodes, `decide_many`, in one transfer too)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def decide(self, accept: torch.Tensor | None, dists: list[torch.Tensor]) -> tuple[int | None, list[int]]:
        return self.decide_many([(accept, dists)])[0]

    def decide_many(self, requests: list[tuple[torch.Tensor | None, list[torch.Tensor]]]
                    ) -> list[tuple[int | None, list[int]]]:
        """`decide` for each request, drawn in order (the same draws as one `decide` after another), read back in
        one transfer."""
        outcomes = []
        for accept, dists in requests:
            device = accept.device if accept is not None else dists[0].device
            where = self.generator.device if self.generator is not None else device  # no generator: that device's RNG
            drawn = [torch.multinomial(d.to(where), 1, generator=self.generator).to(device) for d in dists]
            if accept is None:
                outcomes.append(torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), *drawn]))
                continue
            k = len(accept)
            uniforms = torch.rand(k, dtype=accept.dtype, generator=self.generator, device=where).to(device)
            first = torch.where(uniforms < accept, torch.arange(k, device=device), k).amin(0, keepdim=True)
            outcomes.append(torch.cat([torch.where(first < k, first, -1), *drawn]))
        devices = {outcome.device for outcome in outcomes}
        flat = (torch.cat(outcomes) if len(devices) == 1 else torch.cat([o.cpu() for o in outcomes])).tolist()
        decided, at = [], 0
        for outcome in outcomes:  # the one read
            rank, *tokens = flat[at : at + len(outcome)]
            decided.append((None if rank < 0 else rank, tokens))
            at += len(outcome)
        return decided


def run_walks(walks: list[Generator], source: RandomSource) -> list[Verdict]:
    """Run tree walks (`base.walk_down` generators) in lockstep: each round every walk still descending states the
    decision it needs, and the source makes them all (in one read where it can, `TorchRandom.decide_many`; else one
    `decide` after another). Returns each walk's verdict."""
    verdicts: list[Verdict | None] = [None] * len(walks)
    pending: dict[int, tuple] = {}

    def advance(index: int, outcome) -> None:
        try:
            pending[index] = walks[index].send(outcome)
        except StopIteration as done:
            pending.pop(index, None)
            verdicts[index] = done.value

    for index in range(len(walks)):
        advance(index, None)
    while pending:
        order = list(pending)
        many = getattr(source, "decide_many", None)
        requests = [pending[index] for index in order]
        outcomes = many(requests) if many is not None else [source.decide(*request) for request in requests]
        for index, outcome in zip(order, outcomes):
            advance(index, outcome)
    return verdicts


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


def _residual_walk(
    tree: TokenTree, target_scores: torch.Tensor, without_replacement: bool
) -> Generator[tuple, tuple, Verdict]:
    """Recursive rejection sampling (SpecInfer; Sequoia/SpecTr when `without_replacement`), as a walk.

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
            _, drawn = yield None, [p]
            return None, drawn[0]
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
        rank, drawn = yield accept, [residual, *_target_dists(target_scores, leaves, dtype)]
        if rank is None:
            return None, drawn[0]
        child = children[rank]
        return child, (drawn[1 + leaves.index(child)] if child in leaves else None)

    return (yield from walk_down(tree, choose))


class _Walking:
    """A verifier whose verdict is a tree walk (`walk(tree, scores)`): one tree, or a batch's trees in lockstep."""

    walks: ClassVar[bool] = True  # reads the target scores of the nodes it visits only (see NodeScores)

    def walk(self, tree: TokenTree, target_scores: torch.Tensor) -> Generator[tuple, tuple, Verdict]:
        raise NotImplementedError

    def verify(
        self,
        tree: TokenTree,
        target_scores: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        source: RandomSource | None = None,
    ) -> Verdict:
        return run_walks([self.walk(tree, target_scores)], source or TorchRandom(generator))[0]

    def verify_rows(self, trees: list[TokenTree], target_scores: list[torch.Tensor],
                    generator: torch.Generator | None = None) -> list[Verdict]:
        """Every row's verdict, the rows walking in lockstep: one read per level any row visits, not per row."""
        walks = [self.walk(tree, scores) for tree, scores in zip(trees, target_scores)]
        return run_walks(walks, TorchRandom(generator))


@register_verifier
class SequoiaVerifier(_Walking):
    """Exact for children drawn without replacement from q (Sequoia / SpecTr-style recursive rejection)."""

    name: ClassVar[str] = "sequoia"
    child_selection: ClassVar[str] = "without_replacement"

    def walk(self, tree: TokenTree, target_scores: torch.Tensor) -> Generator[tuple, tuple, Verdict]:
        return _residual_walk(tree, target_scores, without_replacement=True)


@register_verifier
class SpecInferVerifier(_Walking):
    """Exact for children drawn i.i.d. from q (SpecInfer's multi-step speculative sampling)."""

    name: ClassVar[str] = "specinfer"
    child_selection: ClassVar[str] = "with_replacement"

    def walk(self, tree: TokenTree, target_scores: torch.Tensor) -> Generator[tuple, tuple, Verdict]:
        return _residual_walk(tree, target_scores, without_replacement=False)


@register_verifier
class TargetSampleVerifier(_Walking):
    """Sample from the target at each node and descend while a child carries the sample.

    Exact for any tree whose shape and tokens do not depend on the target's randomness (top-k, best-first,
    n-gram drafts): the emitted tokens are literally target samples; the tree only decides how many per step.
    """

    name: ClassVar[str] = "target_sample"
    child_selection: ClassVar[str] = "top_k"

    def walk(self, tree: TokenTree, target_scores: torch.Tensor) -> Generator[tuple, tuple, Verdict]:
        tokens = tree.host(tokens=True).tokens
        dtype = _work_dtype(target_scores.device)
        children_of = tree.host().children()

        def choose(node: int, children: list[int]):
            leaves = [child for child in children if not children_of[child]]
            _, drawn = yield None, _target_dists(target_scores, [node, *leaves], dtype)
            for child in children:
                if tokens[child] == drawn[0]:
                    return child, (drawn[1 + leaves.index(child)] if child in leaves else None)
            return None, drawn[0]

        return (yield from walk_down(tree, choose))
