"""The call's logits processors on every row of a captured step at once, each row with its own ids, in shapes that do
not change from step to step (decoding/captured.py).

A node's ids are the committed sequence, then the drafted tokens from the root's child down to the node itself. A
captured step cannot cut them to their lengths (one graph per shape), so every node's ids have one width: a buffer of
the committed sequence as wide as the target's static cache, then one column per tree node; every column past the
sequence, or off the node's path, holds an id past the vocabulary. That is exact for the processors that read no ids
(`ROW_WISE`) and for those that read the ids as a set and skip ids past the vocabulary (`ID_SET`: Transformers'
repetition penalty clamps them onto a column it then drops, its rule for models whose embeddings outnumber their
output rows). Processors that read lengths, n-grams or the order of the ids are not exact so: `unsupported` names them.
"""

from __future__ import annotations

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

#: processors that read a row alone, never the ids before it
ROW_WISE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
            EpsilonLogitsWarper, EtaLogitsWarper, SuppressTokensLogitsProcessor, LogitNormalization,
            InfNanRemoveLogitsProcessor)
#: processors that read the ids as a set, skipping ids past the vocabulary
ID_SET = (RepetitionPenaltyLogitsProcessor,)


def unsupported(processors: LogitsProcessorList | None) -> list[str]:
    """The names of the processors a fixed width cannot give their ids exactly (neither `ROW_WISE` nor `ID_SET`)."""
    return [type(p).__name__ for p in processors or () if not isinstance(p, (*ROW_WISE, *ID_SET))]


def reads_ids(processors: LogitsProcessorList | None) -> bool:
    return any(isinstance(p, ID_SET) for p in processors or ())


class NodeIds:
    """The committed sequence in a fixed-width buffer on the target's device, written as steps commit tokens, and
    every node's ids built from it (`of`). Rows past the sequence's length are stale and never read."""

    def __init__(self, prompt: torch.Tensor, width: int, vocab: int) -> None:
        """`prompt` `(P,)` on the target's device; `width`: the most tokens the sequence reaches (the target's static
        cache's rows, plus one); `vocab`: the processed rows' width (the ids past it are skipped)."""
        if len(prompt) > width:
            raise ValueError(f"A prompt of {len(prompt)} tokens does not fit a sequence of {width}.")
        self.vocab = vocab
        self.buffer = torch.full((width,), vocab, dtype=torch.long, device=prompt.device)
        self.buffer[: len(prompt)] = prompt
        torch._dynamo.mark_static_address(self.buffer)  # written in place: a CUDA graph keeps its address

    def of(self, past: torch.Tensor, tokens: torch.Tensor | None = None,
           ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """The ids `(n, width + n)` of a tree's nodes (one row, the root's, without `tokens`): the sequence through
        the root at index `past`, then node i's path below the root, `tokens` `(n,)` (-1: a node the draft did not
        fill) where `ancestors[i]` `(n, n)` (a node its own ancestor), the vocabulary's width elsewhere."""
        columns = torch.arange(len(self.buffer), device=self.buffer.device)
        sequence = torch.where(columns <= past, self.buffer, self.vocab)[None]
        if tokens is None:
            return sequence
        below = ancestors & (torch.arange(len(tokens), device=tokens.device) > 0)[None]  # the root: `past`'s token
        path = torch.where(below & (tokens >= 0)[None], tokens[None], self.vocab)
        return torch.cat([sequence.expand(len(tokens), -1), path], dim=1)

    def write(self, at: torch.Tensor, tokens: torch.Tensor) -> None:
        """Committed `tokens` at positions `at` (each `(k,)`); later writes may overwrite rows past the length."""
        self.buffer.index_copy_(0, at, tokens)
