"""Prompt-lookup as a tree: continuations of earlier occurrences of the context's last n-gram, merged into a trie.

Nearly free (no model), and strong whenever the output repeats its input: code edits, summaries, extraction.
`speculation="prompt_lookup"` drafts with it alone; a staged stack uses it as its cheapest stage.
"""

from __future__ import annotations

import torch

from ...core.drafter import Drafter
from ...core.tree import TokenTree
from ...core.verdict import Verdict
from ...draft.draft_model import HostSequence, emitted_tokens
from ...plan.shape_sizing import PlainProbes
from .sizing import LookupSizer


class PromptLookupDrafter(Drafter):
    """Matches the last `max_ngram`..`min_ngram` tokens against the context.

    Every match contributes its next `depth` tokens; they are merged into a trie whose nodes are ranked by how
    many matches pass through them, and the `max_nodes` most supported nodes form the tree (always connected,
    since a child never has more support than its parent). With a `sizer`, each proposed tree is cut to the nodes
    that pay for the target's longer pass (`sizing.py`), possibly to the root alone (a plain step), and
    `PlainProbes` proposes the whole tree now and then after plain choices, so acceptance that returns is seen.
    A staged stack's lower stage (`propose_ids`) is never cut: its trees only guide the stage above.
    """

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 1, depth: int = 8, max_nodes: int = 32, max_matches: int = 32,
        sizer: LookupSizer | None = None,
    ) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.depth, self.max_nodes, self.max_matches = depth, max_nodes, max_matches
        self.forward_count = 0
        self.sequence = HostSequence()
        self.sizer = sizer
        self.shrunk_steps = 0  # proposals the sizing cut below the full tree (to the root alone not counted)
        self.probes = PlainProbes()
        self._proposed: tuple[list[int], list[float]] = ([-1], [1.0])  # parents and match shares of the last tree

    @property
    def num_drafting_tokens(self) -> int:
        return self.depth

    def continuations(self, ids: list[int]) -> list[list[int]]:
        """Continuations of every recurring n-gram, n from `max_ngram` down to `min_ngram`, most recent first.

        A match of a long n-gram is also a match of its shorter suffixes, so it is counted once per n:
        longer agreement earns more support. Plain Python on the host copy of the sequence: no tensor is read.
        """
        found = []
        last = ids[-1]
        ends = [i + 1 for i in range(len(ids) - 2, -1, -1) if ids[i] == last]  # n-grams ending before the last token
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            starts = [end for end in ends if end >= n and ids[end - n : end] == tail][: self.max_matches]
            found += [ids[s : s + self.depth] for s in starts]
        return found

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        tokens, parents, shares = self.trie(self.sequence.read(input_ids))  # the prompt is read once, then kept
        if self.sizer is not None and len(tokens) > 1:
            tokens, parents, shares = self._sized(tokens, parents, shares)
        self._proposed = (parents, shares)
        return TokenTree.from_parents(tokens, parents)

    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        if self.sizer is not None:
            self.sizer.slope.observe(tree_size, seconds)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        if self.sizer is not None and len(tree) > 1 and len(tree) == len(self._proposed[0]):
            self.sizer.learn(*self._proposed, verdict.path)
        self.sequence.extend(input_ids, emitted_tokens(tree, verdict))

    def propose_ids(self, ids: list[int]) -> TokenTree:
        tokens, parents, _ = self.trie(ids)
        return TokenTree.from_parents(tokens, parents)

    def trie(self, ids: list[int]) -> tuple[list[int], list[int], list[float]]:
        """The tree's tokens and parents (breadth-first, the root first), and each node's share of its parent's
        matches (1 at the root)."""
        trie: dict[tuple[int, ...], int] = {}  # path of tokens -> number of matches through it
        continuations = self.continuations(ids)
        for continuation in continuations:
            for end in range(1, len(continuation) + 1):
                key = tuple(continuation[:end])
                trie[key] = trie.get(key, 0) + 1
        trie[()] = len(continuations)
        # Best supported nodes first; a shorter path wins ties so parents precede children.
        chosen = sorted((p for p in trie if p), key=lambda path: (-trie[path], len(path)))[: self.max_nodes - 1]
        # Breadth-first order, siblings by support: sort by depth, then by the support of each ancestor.
        chosen.sort(key=lambda path: (len(path), [-trie[path[:i]] for i in range(1, len(path) + 1)], path))
        index = {(): 0}
        tokens, parents, shares = [ids[-1]], [-1], [1.0]
        for path in chosen:
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
            shares.append(trie[path] / trie[path[:-1]])
        return tokens, parents, shares

    def _sized(
        self, tokens: list[int], parents: list[int], shares: list[float]
    ) -> tuple[list[int], list[int], list[float]]:
        """The nodes of the best predicted size (values sorted descending; a child never outranks its parent, and
        the sort is stable, so the kept nodes are connected), in their breadth-first order."""
        values = self.sizer.values(parents, shares)
        ranked = sorted(range(1, len(tokens)), key=lambda node: -values[node])
        size = self.sizer.best_size([values[node] for node in ranked])
        if self.probes.probe(size == 1):
            size = len(tokens)  # the probe: the whole tree, so every node's acceptance is seen
        elif size == 1:
            return tokens[:1], parents[:1], shares[:1]
        if size < len(tokens):
            self.shrunk_steps += 1
        kept = sorted([0, *ranked[: size - 1]])
        position = {node: i for i, node in enumerate(kept)}
        return ([tokens[n] for n in kept], [position.get(parents[n], -1) for n in kept],
                [shares[n] for n in kept])


NGramDrafter = PromptLookupDrafter  # its older name, kept importable
