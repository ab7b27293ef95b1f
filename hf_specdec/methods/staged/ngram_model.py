"""A backoff n-gram language model over token ids: a nearly free lowest drafting stage (Staged SD used a Katz trigram).

Katz backoff with absolute discounting: a continuation `w` seen after context `h` gets `(c(h, w) - D) / c(h)`; the
mass `D * N(h) / c(h)` freed by the discount goes to unseen continuations in proportion to the shorter context's
probabilities, renormalised over them (the Katz alpha). One discount per context length, Ney's `n1 / (n1 + 2 n2)`.
Pruning (`min_count`, `top_k` continuations per context) happens before estimation, so the saved table *is* the model
and a reload gives identical probabilities. Files are plain JSON (never pickle): loading one runs no code.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...core.drafter import Drafter
from ...core.tree import TokenTree

FORMAT = "hf_specdec.ngram_model"
VERSION = 1


@dataclass
class NGramModel:
    """Counts of continuations per context, for contexts of 0 .. order - 1 tokens, and one discount per length.

    `tables[n]` maps a context of `n` token ids to `{next token: count}`; `discounts[n]` applies to `tables[n]`
    (the unigram table, n = 0, is never discounted: it has nothing to back off to).
    """

    order: int
    tables: list[dict[tuple[int, ...], dict[int, int]]]
    discounts: list[float]
    metadata: dict[str, Any] = field(default_factory=dict)
    _totals: list[dict[tuple[int, ...], int]] = field(default_factory=list, repr=False)
    _alphas: dict[tuple[int, ...], float] = field(default_factory=dict, repr=False)
    _dists: dict[tuple[int, ...], list[tuple[int, float]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.order < 1 or len(self.tables) != self.order or len(self.discounts) != self.order:
            raise ValueError(f"An order-{self.order} n-gram model needs {self.order} tables and discounts.")
        self._totals = [{ctx: sum(nxt.values()) for ctx, nxt in table.items()} for table in self.tables]

    # ------------------------------------------------------------------ training
    @classmethod
    def train(
        cls,
        sequences: Iterable[Sequence[int] | torch.Tensor],
        order: int = 3,
        min_count: int = 1,
        top_k: int = 16,
        metadata: dict[str, Any] | None = None,
    ) -> NGramModel:
        """Count the n-grams of token-id sequences (each a list or 1-D tensor), prune, estimate the discounts."""
        if order < 1 or min_count < 1 or top_k < 1:
            raise ValueError(f"Need order >= 1, min_count >= 1 and top_k >= 1, got {order}, {min_count}, {top_k}.")
        grams: list[Counter] = [Counter() for _ in range(order)]
        num_tokens = 0
        for seq in sequences:
            seq = seq.tolist() if isinstance(seq, torch.Tensor) else list(seq)
            num_tokens += len(seq)
            for n in range(order):  # (n + 1)-grams: context of n tokens, then the continuation
                grams[n].update(zip(*(seq[i:] for i in range(n + 1))))
        discounts = [0.0] + [_ney_discount(grams[n]) for n in range(1, order)]
        tables: list[dict[tuple[int, ...], dict[int, int]]] = []
        for n in range(order):
            table: dict[tuple[int, ...], dict[int, int]] = {}
            for gram, count in grams[n].items():
                if count >= min_count:
                    table.setdefault(gram[:-1], {})[gram[-1]] = count
            if n > 0:  # the unigram table stays whole: it is small and the last resort
                table = {ctx: dict(heapq.nlargest(top_k, nxt.items(), key=lambda kv: (kv[1], -kv[0])))
                         for ctx, nxt in table.items()}
            tables.append(table)
        meta = {"num_tokens": num_tokens, "min_count": min_count, "top_k": top_k, **(metadata or {})}
        return cls(order=order, tables=tables, discounts=discounts, metadata=meta)

    @classmethod
    def from_model_samples(
        cls,
        model: Any,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int = 256,
        samples_per_prompt: int = 1,
        seed: int = 0,
        **train_kwargs: Any,
    ) -> NGramModel:
        """Train on text sampled from `model` (e.g. the draft itself) after each prompt `(1, L)`: plain sampling."""
        torch.manual_seed(seed)
        sequences = []
        for prompt in prompts:
            for _ in range(samples_per_prompt):
                out = model.generate(prompt, do_sample=True, max_new_tokens=max_new_tokens)
                sequences.append(out[0].tolist())
        meta = {"source": f"samples of {type(model).__name__}", **train_kwargs.pop("metadata", {})}
        return cls.train(sequences, metadata=meta, **train_kwargs)

    # ------------------------------------------------------------------ probabilities
    def prob(self, token: int, context: Sequence[int]) -> float:
        """P(token | the last order - 1 tokens of context), with Katz backoff."""
        ctx = tuple(context)[len(context) - self.order + 1 :] if self.order > 1 else ()
        return self._prob(int(token), ctx)

    def _prob(self, token: int, ctx: tuple[int, ...]) -> float:
        while True:
            n = len(ctx)
            nxt = self.tables[n].get(ctx)
            if n == 0:
                total = self._totals[0].get((), 0)
                return nxt.get(token, 0) / total if nxt and total else 0.0
            if nxt is None:  # unseen context: back off with weight 1
                ctx = ctx[1:]
                continue
            count = nxt.get(token)
            if count:
                return (count - self.discounts[n]) / self._totals[n][ctx]
            return self._alpha(ctx) * self._prob(token, ctx[1:])

    def _alpha(self, ctx: tuple[int, ...]) -> float:
        """Katz's backoff weight: the discounted mass over the shorter context's mass on unseen continuations."""
        if ctx not in self._alphas:
            n, nxt = len(ctx), self.tables[len(ctx)][ctx]
            freed = self.discounts[n] * len(nxt) / self._totals[n][ctx]
            left = 1.0 - sum(self._prob(w, ctx[1:]) for w in nxt)
            self._alphas[ctx] = freed / left if left > 1e-12 else 0.0
        return self._alphas[ctx]

    def next_tokens(self, context: Sequence[int]) -> list[tuple[int, float]]:
        """Candidate next tokens with their probabilities, most probable first: every continuation stored for any
        suffix of the context (the only tokens that can rank high; the rest share the unigram tail)."""
        ctx = tuple(int(t) for t in context)[len(context) - self.order + 1 :] if self.order > 1 else ()
        if ctx not in self._dists:
            candidates: set[int] = set()
            for start in range(len(ctx) + 1):
                sub = ctx[start:]
                if sub and sub not in self.tables[len(sub)]:
                    continue
                table = self.tables[len(sub)].get(sub, {})
                candidates.update(table if sub else heapq.nlargest(64, table, key=table.get))
            dist = sorted(((t, self._prob(t, ctx)) for t in candidates), key=lambda tp: (-tp[1], tp[0]))
            if len(self._dists) > 100_000:
                self._dists.clear()
            self._dists[ctx] = dist
        return self._dists[ctx]

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write the model as JSON: contexts as space-separated ids, each with its continuation ids and counts."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "order": self.order,
            "discounts": self.discounts,
            "metadata": self.metadata,
            "tables": [
                {" ".join(map(str, ctx)): [list(nxt), list(nxt.values())] for ctx, nxt in table.items()}
                for table in self.tables
            ],
        }
        Path(path).write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> NGramModel:
        """Read a file written by `save` (or `hf-specdec ngram train`); a clear error for anything else."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"No n-gram model file at {str(path)!r}: train one with `hf-specdec ngram train --output {path}` "
                "or NGramModel.train(...).save(path)."
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not an n-gram model file (JSON written by NGramModel.save): {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not an n-gram model file: its 'format' field is not {FORMAT!r}.")
        if data.get("version") != VERSION:
            raise ValueError(f"{path} has n-gram model format version {data.get('version')!r}; this hf_specdec reads "
                             f"version {VERSION}. Retrain it with `hf-specdec ngram train`.")
        tables = [
            {tuple(int(t) for t in key.split()): dict(zip(map(int, toks), map(int, counts)))
             for key, (toks, counts) in table.items()}
            for table in data["tables"]
        ]
        return cls(order=int(data["order"]), tables=tables, discounts=[float(d) for d in data["discounts"]],
                   metadata=dict(data.get("metadata", {})))


def _ney_discount(grams: Counter) -> float:
    """Ney's absolute discount n1 / (n1 + 2 n2) from the count-of-counts (0.5 when undefined)."""
    of = Counter(count for count in grams.values() if count <= 2)
    n1, n2 = of[1], of[2]
    return n1 / (n1 + 2 * n2) if n1 + n2 else 0.5


class NGramModelDrafter(Drafter):
    """Proposes the n-gram model's most probable continuations of the context as a tree, grown best-first.

    Each expanded node adds its `width` most probable next tokens; the `max_nodes` paths of highest cumulative
    probability (at least `min_prob`, at most `depth` tokens) form the tree. Deterministic, no model passes.
    """

    def __init__(
        self, model: NGramModel, width: int = 2, depth: int = 6, max_nodes: int = 12, min_prob: float = 0.01
    ) -> None:
        self.model, self.width, self.depth, self.max_nodes, self.min_prob = model, width, depth, max_nodes, min_prob

    @property
    def num_drafting_tokens(self) -> int:
        return self.depth

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        return self.propose_ids(input_ids[0].tolist())

    def propose_ids(self, ids: list[int]) -> TokenTree:
        root, context = ids[-1], ids[len(ids) - self.model.order + 1 :] if self.model.order > 1 else []
        chosen: list[tuple[tuple[int, ...], float]] = []
        heap: list[tuple[float, int, tuple[int, ...]]] = [(-1.0, 0, ())]  # (-cumulative prob, tie-break, path)
        counter = 1
        while heap and len(chosen) < self.max_nodes - 1:
            neg, _, path = heapq.heappop(heap)
            if path:
                chosen.append((path, -neg))
            if len(path) >= self.depth:
                continue
            for token, p in self.model.next_tokens(context + list(path))[: self.width]:
                if -neg * p >= self.min_prob:
                    heapq.heappush(heap, (neg * p, counter, path + (token,)))
                    counter += 1
        return TokenTree.from_paths(root, [path for path, _ in chosen])
