"""The random decisions of the sampling verifiers, behind a small protocol so tests can enumerate every branch of the
real code (a scripted source); the default one draws with a `torch.Generator` (or the global RNG), so seeded runs
reproduce. Every outcome stays a device tensor nobody has read: a walk decides level after level and reads once."""

from __future__ import annotations

from typing import Protocol

import torch

Dist = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a distribution: see RandomSource


class RandomSource(Protocol):
    """The random decisions of a walk, one per level.

    A distribution is a `(V,)` tensor of probabilities by token, or a pair `(probs, columns)`, both `(k,)`: mass
    `probs[j]` on token `columns[j]` (a repeated column's masses add), for rows that have mass on a few columns only
    (after a top-k: `NodeScores.top_at`)."""

    def decide(self, accept: torch.Tensor, dist: Dist) -> tuple[torch.Tensor, torch.Tensor]:
        """Trials `i = 0..k-1`, each succeeding independently with probability `accept[i]` `(k,)`: the index of the
        first that succeeds, `k` where none does; and, for when none does, a token drawn from `dist` (independently:
        where a trial succeeds the token means nothing, and a scripted source need not draw it). Both `(1,)` long
        tensors on their inputs' devices, unread."""
        ...

    def draw(self, dist: Dist) -> torch.Tensor:
        """A token drawn from the normalized distribution `dist`, as a `(1,)` long tensor on its device, unread."""
        ...


class TorchRandom:
    """`RandomSource` on a `torch.Generator` (None: torch's global RNG), drawing on the generator's device."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def decide(self, accept: torch.Tensor, dist: Dist) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(accept), self.draw(dist)

    def first(self, accept: torch.Tensor) -> torch.Tensor:
        """`decide`'s first successful trial."""
        k, device = len(accept), accept.device
        if not k:
            return torch.zeros(1, dtype=torch.long, device=device)  # no trials: none succeeds, index k = 0
        where = self.generator.device if self.generator is not None else device
        uniforms = torch.rand(k, dtype=accept.dtype, generator=self.generator, device=where).to(device)
        return torch.where(uniforms < accept, torch.arange(k, device=device), k).amin(0, keepdim=True)

    def draw(self, dist: Dist) -> torch.Tensor:
        """Inverse transform sampling, as `torch.multinomial` does it (the first column whose cumulative mass passes a
        uniform draw), without its 3-4 ms per 150k-wide row on a CPU; columns of no mass are never drawn. A pair
        `(probs, columns)` is drawn over its k entries, then mapped to its column."""
        probs = dist if isinstance(dist, torch.Tensor) else dist[0]
        where = self.generator.device if self.generator is not None else probs.device
        cdf = probs.to(where).cumsum(0)
        total = cdf[-1:]
        uniform = torch.rand(1, dtype=cdf.dtype, generator=self.generator, device=where)
        index = torch.searchsorted(cdf, uniform * total, right=True)
        last = (cdf < total).sum(0, keepdim=True)  # the last column with mass, should `uniform * total` round up
        index = torch.minimum(index, last).to(probs.device)
        return index if isinstance(dist, torch.Tensor) else dist[1].index_select(0, index.to(dist[1].device))
