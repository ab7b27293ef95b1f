"""Apply the caller's logits processors to every tree node, each with that node's own prefix."""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList, PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

from .narrowed import apply_narrowed, narrowed_plan
from .tree import TokenTree

# Processors that read a row's batch index, not only its tokens: `prefix_allowed_tokens_fn(batch_id, sentence)`.
# Nodes batched as rows would show up as batch ids 0..k-1 of a batch of k, while each node is the one real sequence
# (batch id 0): these see one node at a time.
ONE_ROW_AT_A_TIME = (PrefixConstrainedLogitsProcessor,)


def row_processors(processors: LogitsProcessorList | None, row: int, rows: int) -> LogitsProcessorList | None:
    """The processors of row `row` of a batch of `rows`, for calls that see that row's tree nodes (any number of
    sequences, all of that row). Plain batched generate builds some with per-row state: a repetition penalty that
    skips each row's left padding (`prompt_ignore_length`, one entry per row) gets the row's entry; a prefix
    constraint gets the row's batch id. The others are shared as they are."""
    if not processors or rows == 1:
        return processors
    out = LogitsProcessorList()
    for processor in processors:
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor):
            if ignore.shape[0] != rows:
                raise ValueError(f"A repetition penalty built for {ignore.shape[0]} rows cannot score a batch of "
                                 f"{rows}: build it with an int prompt_ignore_length (or none).")
            processor = copy.copy(processor)
            processor.prompt_ignore_length = int(ignore[row])  # read once per row, before decoding
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = _RowPrefix(processor._prefix_allowed_tokens_fn, row)
        out.append(processor)
    return out


class _RowPrefix:
    """`prefix_allowed_tokens_fn` called with the batch row's id, whatever id the call is made with (each node of
    one row is scored as batch id 0)."""

    def __init__(self, function, row: int) -> None:
        self.function, self.row = function, row

    def __call__(self, batch_id: int, sentence: torch.Tensor):
        return self.function(self.row, sentence)


def process_tree_scores(
    processors: LogitsProcessorList | None,
    prefix_ids: torch.Tensor,
    tree: TokenTree,
    logits: torch.Tensor,
    nodes: torch.Tensor | list[int] | None = None,
    any_tie_order: bool = False,
) -> torch.Tensor:
    """Return float32 `(len(nodes), vocab)` scores, processed exactly as plain `generate` would at each node.

    `prefix_ids` is `(1, L)` and ends *before* the root; node i's sequence is prefix + root..i. Everything runs
    where `logits` are (the device of the model that made them). Nodes of equal depth share a sequence length, so
    they are processed as one batch per depth, grouped on the host (give `nodes` as a list: no device read).
    `any_tie_order`: the caller takes any order among equal scores at a top-p cut (a draft's proposal, which only
    has to be the distribution its tokens are drawn from), so top-p after top-k runs in linear time (`narrowed.py`).
    """
    if not processors:
        return logits.float()  # no copy when already float32: nothing below writes into it
    device = logits.device
    nodes = list(range(len(tree))) if nodes is None else nodes
    nodes = nodes.tolist() if isinstance(nodes, torch.Tensor) else nodes
    depths = tree.host().depths()
    groups: dict[int, list[int]] = {}
    for row, node in enumerate(nodes):
        groups.setdefault(depths[node], []).append(row)
    scores = logits.to(dtype=torch.float32, copy=True)
    prefix_ids = prefix_ids.to(device)
    for rows in groups.values():
        seqs = tree.prefix_tokens([nodes[row] for row in rows]).to(device)
        ids = torch.cat([prefix_ids.expand(len(rows), -1), seqs], dim=1)
        index = torch.tensor(rows).to(device)
        scores[index] = _apply(processors, ids, scores[index], any_tie_order)
    return scores


def _apply(processors: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor,
           any_tie_order: bool = False) -> torch.Tensor:
    """`processors(ids, scores)`, with the processors of ONE_ROW_AT_A_TIME called once per row (batch id 0)."""
    if not any(isinstance(processor, ONE_ROW_AT_A_TIME) for processor in processors):
        plan = narrowed_plan(processors) if any_tie_order else None
        return processors(ids, scores) if plan is None else apply_narrowed(plan, ids, scores)
    for processor in processors:
        if isinstance(processor, ONE_ROW_AT_A_TIME):
            scores = torch.cat([processor(ids[i : i + 1], scores[i : i + 1]) for i in range(len(ids))])
        else:
            scores = LogitsProcessorList([processor])(ids, scores)
    return scores


class NodeScores:
    """`process_tree_scores` row by row, each node's row computed on first use and kept.

    A sampling verifier walks down from the root and reads a handful of nodes of a tree of dozens or thousands, and
    the processors are most of its cost (top-p sorts the whole vocabulary per row): only the visited rows are
    processed, each exactly as `process_tree_scores` does it. Index with a node, or a list of nodes.
    """

    def __init__(
        self, processors: LogitsProcessorList | None, prefix_ids: torch.Tensor, tree: TokenTree, logits: torch.Tensor
    ) -> None:
        self.processors, self.prefix_ids, self.tree, self.logits = processors, prefix_ids, tree, logits
        self.rows: dict[int, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, node: int | list[int]) -> torch.Tensor:
        if isinstance(node, list):
            return torch.stack([self[n] for n in node])
        node = int(node)
        if node not in self.rows:
            row = self.logits[node : node + 1]
            self.rows[node] = process_tree_scores(self.processors, self.prefix_ids, self.tree, row, [node])[0]
        return self.rows[node]
