"""Apply the caller's logits processors to every tree node, each with that node's own prefix."""

from __future__ import annotations

import copy

import torch
from transformers import (
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from ..core.tree import TokenTree
from .narrowed import (
    apply_narrowed,
    deferred,
    exact_top_columns,
    exact_top_split,
    narrowed_plan,
    top_columns,
    topk_split,
)

# Processors that read a row's batch index, not only its tokens: `prefix_allowed_tokens_fn(batch_id, sentence)`.
# Nodes batched as rows would show up as batch ids 0..k-1 of a batch of k, while each node is the one real sequence
# (batch id 0): these see one node at a time.
ONE_ROW_AT_A_TIME = (PrefixConstrainedLogitsProcessor,)


def row_processors(processors: LogitsProcessorList | None, row: int, rows: int) -> LogitsProcessorList | None:
    """The processors of row `row` of a batch of `rows`, for calls that see that row's tree nodes (any number of
    sequences, all of that row). Plain batched generate builds some with per-row state: a repetition penalty that
    skips each row's left padding (`prompt_ignore_length`, one entry per row) gets the row's entry; a prefix
    constraint gets the batch id plain `generate` gives the row. The others are shared as they are. One sequence
    (`rows` 1) whose rows are its tree's nodes gets the same: its penalty's entry reads any number of rows."""
    if not processors:
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
            # plain's batch id: the row's prompt, its rows grouped as the processor was built (`num_beams` rows per
            # prompt; from Transformers 5.24 on, `num_return_sequences` of them); each call here sees one row
            processor = copy.copy(processor)
            prompt, processor._num_beams = row // processor._num_beams, 1
            processor._prefix_allowed_tokens_fn = _RowPrefix(processor._prefix_allowed_tokens_fn, prompt)
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
    scores = logits.to(dtype=torch.float32, copy=True)
    for index, ids in _depth_groups(prefix_ids, tree, nodes, device):
        rows = process_rows(processors, ids, scores if index is None else scores[index], any_tie_order)[0]
        if index is None:
            scores = rows
        else:
            scores[index] = rows
    return scores


def _depth_groups(prefix_ids: torch.Tensor, tree: TokenTree, nodes: torch.Tensor | list[int] | None,
                  device: torch.device):
    """`(index, ids)` per depth among `nodes`: the rows of that depth (a device index; None when one depth holds
    every row in order: no gather or scatter needed) and their sequences `(rows, L + depth + 1)`."""
    nodes = list(range(len(tree))) if nodes is None else nodes
    nodes = nodes.tolist() if isinstance(nodes, torch.Tensor) else nodes
    depths = tree.host().depths()
    groups: dict[int, list[int]] = {}
    for row, node in enumerate(nodes):
        groups.setdefault(depths[node], []).append(row)
    prefix_ids = prefix_ids.to(device)
    for rows in groups.values():
        seqs = tree.prefix_tokens([nodes[row] for row in rows]).clamp(min=0).to(device)  # an unfilled node: 0
        ids = torch.cat([prefix_ids.expand(len(rows), -1), seqs], dim=1)
        yield (None if len(groups) == 1 else torch.tensor(rows).to(device)), ids


def draft_top_scores(
    processors: LogitsProcessorList | None,
    prefix_ids: torch.Tensor,
    tree: TokenTree,
    logits: torch.Tensor,
    nodes: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A draft's processed scores at `nodes` as their k best columns, `(values, columns)` each `(len(nodes), k)`
    (`narrowed.top_columns`: every other column is -inf), where the processors end with a -inf top-k followed by
    temperature / top-p only; None otherwise (use `process_tree_scores`). For a draft's proposal only: a tie at
    the k-th value keeps k columns, where Transformers keeps them all."""
    split = topk_split(processors) if processors else None
    if split is None:
        return None
    early, k, late = _late_head(split)
    device = logits.device
    width = min(k, logits.shape[-1])
    values = torch.empty(len(logits), width, device=device)
    columns = torch.empty(len(logits), width, dtype=torch.long, device=device)
    for index, ids in _depth_groups(prefix_ids, tree, nodes, device):
        rows = logits if index is None else logits[index]
        if len(early):  # on a copy: a processor may write into its input
            rows = _apply(early, ids, rows.to(dtype=torch.float32, copy=index is None))
        top = top_columns(k, late, ids, rows)
        if index is None:
            return top
        values[index], columns[index] = top
    return values, columns


def _late_head(split: tuple[LogitsProcessorList, int, LogitsProcessorList]
               ) -> tuple[LogitsProcessorList, int, LogitsProcessorList]:
    """`(early, k, late)`: the processors to run on whole rows before the top-k, and those that can run after it
    on its k columns (a head of temperatures only, `narrowed.deferred`, then the tail)."""
    head, k, tail = split
    if deferred(head):
        return LogitsProcessorList(), k, LogitsProcessorList([*head, *tail])
    return head, k, tail


def process_rows(processors: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor,
                 narrow: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`processors(ids, scores)` on rows that share a sequence length; with `narrow`, top-p after top-k in linear
    time where the list allows, and `(n,)` flags, true for the rows that may not be Transformers' (None: its path)."""
    plan = narrowed_plan(processors) if narrow and not _one_row_at_a_time(processors) else None
    if plan is None:
        return _apply(processors, ids, scores), None
    return apply_narrowed(plan, ids, scores)


def _one_row_at_a_time(processors: LogitsProcessorList) -> bool:
    return any(isinstance(processor, ONE_ROW_AT_A_TIME) for processor in processors)


def _apply(processors: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`processors(ids, scores)`, with the processors of ONE_ROW_AT_A_TIME called once per row (batch id 0)."""
    if not _one_row_at_a_time(processors):
        return processors(ids, scores)
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
    processed, each exactly as `process_tree_scores` does it. Index with a node, or a list of nodes: Transformers'
    own rows. A walk on the device takes a node's row by a device index (`row_at`, `top_at`), narrowed (top-p in
    linear time, `narrowed.py`) with a flag it reads with its outcome, and `keep`s the rows it used.
    """

    def __init__(
        self, processors: LogitsProcessorList | None, prefix_ids: torch.Tensor, tree: TokenTree, logits: torch.Tensor
    ) -> None:
        self.processors, self.prefix_ids, self.tree, self.logits = processors, prefix_ids, tree, logits
        self.rows: dict[int, torch.Tensor] = {}
        self.split = exact_top_split(processors) if processors else None  # see top_at

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
            self.rows[node] = process_tree_scores(self.processors, self.prefix_ids, self.tree,
                                                  self.logits[node : node + 1], [node])[0]
        return self.rows[node]

    def row_at(self, node: torch.Tensor, walked: torch.Tensor,
               narrow: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The row of `node`, a `(1,)` index on the device (never read), whose tokens from the root are `walked`;
        with `narrow`, top-p in linear time where the processors allow, with its `(1,)` flag, true where the row may not
        be Transformers' (None: it is). Not kept: see `keep`."""
        row = self.logits.index_select(0, node).float()
        if not self.processors:
            return row[0], None
        ids = torch.cat([self.prefix_ids.to(row.device), walked[None]], dim=1)
        row, flag = process_rows(self.processors, ids, row, narrow)
        return row[0], flag

    def top_at(self, node: torch.Tensor,
               walked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`row_at` as its top-k columns (`narrowed.exact_top_columns`: `(values, columns)` each `(k,)`, every other
        column -inf) and a `(1,)` flag, true where the row may not be Transformers'; None where the processors do not
        end with a -inf top-k followed by temperature and top-p only."""
        if self.split is None:
            return None
        head, k, tail = self.split
        early, late = (LogitsProcessorList(), head) if deferred(head) else (head, LogitsProcessorList())
        row = self.logits.index_select(0, node)  # a copy, in the logits' dtype
        ids = torch.cat([self.prefix_ids.to(row.device), walked[None]], dim=1)
        row = _apply(early, ids, row.float()) if len(early) else row
        values, columns, unsure = exact_top_columns(k, late, tail, ids, row)
        return values[0], columns[0], unsure

    def keep(self, node: int, row: torch.Tensor) -> None:
        """Keep a row of `row_at` known to be Transformers' (its flag read false, or None)."""
        self.rows[node] = row
