"""Apply the caller's logits processors to every tree node, each with that node's own prefix."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor

from .tree import TokenTree

# Processors that read a row's batch index, not only its tokens: `prefix_allowed_tokens_fn(batch_id, sentence)`.
# Nodes batched as rows would show up as batch ids 0..k-1 of a batch of k, while each node is the one real sequence
# (batch id 0): these see one node at a time.
ONE_ROW_AT_A_TIME = (PrefixConstrainedLogitsProcessor,)


def process_tree_scores(
    processors: LogitsProcessorList | None,
    prefix_ids: torch.Tensor,
    tree: TokenTree,
    logits: torch.Tensor,
    nodes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return float32 `(len(nodes), vocab)` scores, processed exactly as plain `generate` would at each node.

    `prefix_ids` is `(1, L)` and ends *before* the root; node i's sequence is prefix + root..i.
    Nodes of equal depth share a sequence length, so they are processed as one batch per depth.
    """
    if not processors:
        return logits.float()  # no copy when already float32: nothing below writes into it
    nodes = torch.arange(len(tree), device=tree.device) if nodes is None else nodes
    scores = logits.to(dtype=torch.float32, copy=True)
    depths = tree.depths[nodes]
    for depth in depths.unique().tolist():
        rows = torch.nonzero(depths == depth).flatten()
        seqs = tree.prefix_tokens(nodes[rows]).to(prefix_ids.device)
        ids = torch.cat([prefix_ids.expand(len(rows), -1), seqs], dim=1)
        scores[rows] = _apply(processors, ids, scores[rows])
    return scores


def _apply(processors: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`processors(ids, scores)`, with the processors of ONE_ROW_AT_A_TIME called once per row (batch id 0)."""
    if not any(isinstance(processor, ONE_ROW_AT_A_TIME) for processor in processors):
        return processors(ids, scores)
    for processor in processors:
        if isinstance(processor, ONE_ROW_AT_A_TIME):
            scores = torch.cat([processor(ids[i : i + 1], scores[i : i + 1]) for i in range(len(ids))])
        else:
            scores = LogitsProcessorList([processor])(ids, scores)
    return scores
