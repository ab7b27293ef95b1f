"""Prompt-lookup as a tree: continuations of earlier occurrences of the context's last n-gram, merged into a trie.

Nearly free (no model), and strong whenever the output repeats its input: code edits, summaries, extraction.
`speculation="prompt_lookup"` drafts with it alone; a staged stack uses it as its cheapest stage.
"""

from __future__ import annotations

import torch

from ..core.drafter import Drafter
from ..core.tree import TokenTree
from ..core.verdict import Verdict
from .draft_model import HostSequence, emitted_tokens


class PromptLookupDrafter(Drafter):
    """Matches the last `max_ngram`..`min_ngram` tokens against the context.

    Every match contributes its next `depth` tokens; they are merged into a trie whose nodes are ranked by how
    many matches pass through them, and the `max_nodes` most supported nodes form the tree (always connected,
    since a child never has more support than its parent).
    """

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 1, depth: int = 8, max_nodes: int = 32, max_matches: int = 32
    ) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.depth, self.max_nodes, self.max_matches = depth, max_nodes, max_matches
        self.forward_count = 0
        self.sequence = HostSequence()

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
        return self.propose_ids(self.sequence.read(input_ids))  # the prompt is read once, then kept on the host

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        self.sequence.extend(input_ids, emitted_tokens(tree, verdict))

    def propose_ids(self, ids: list[int]) -> TokenTree:
        trie: dict[tuple[int, ...], int] = {}  # path of tokens -> number of matches through it
        for continuation in self.continuations(ids):
            for end in range(1, len(continuation) + 1):
                key = tuple(continuation[:end])
                trie[key] = trie.get(key, 0) + 1
        # Best supported nodes first; a shorter path wins ties so parents precede children.
        chosen = sorted(trie, key=lambda path: (-trie[path], len(path)))[: self.max_nodes - 1]
        # Breadth-first order, siblings by support: sort by depth, then by the support of each ancestor.
        chosen.sort(key=lambda path: (len(path), [-trie[path[:i]] for i in range(1, len(path) + 1)], path))
        index = {(): 0}
        tokens, parents = [ids[-1]], [-1]
        for path in chosen:
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]])
        return TokenTree.from_parents(tokens, parents)


NGramDrafter = PromptLookupDrafter  # its older name, kept importable
