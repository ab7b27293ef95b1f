"""A batch of sequences over one shared cache length, each row with its own valid columns (ragged rows).

Rows of a left-padded batch start with pad columns, and after each speculative step a row that accepted fewer
tokens than the longest row leaves holes (stale columns). `RaggedRows` keeps, on the model's device, which cache
columns of each row hold its tokens; a token's position is the number of valid columns before it, which is what
plain batched `generate` gives it (`cumsum(attention_mask) - 1`). Tree passes get one additive mask per row: the
row's valid columns, then its tree's visibility (`TokenTree.visibility`, the one tree-mask rule).
"""

from __future__ import annotations

import torch
from transformers import Cache

from ..core.tree import TokenTree, additive_mask
from .kv_cache import keep_positions_per_row, select_batch_rows


class RaggedRows:
    """Valid cache columns per batch row: `valid` `(B, L)` bool on the device of the model whose cache it is."""

    def __init__(self, valid: torch.Tensor) -> None:
        self.valid = valid.bool()

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def tree_inputs(
        self, trees: list[TokenTree], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids `(B, n)`, position ids `(B, n)` and the additive mask `(B, 1, n, L + n)` of one pass over
        each row's tree (n: the largest tree). A smaller tree is padded with dummy nodes that see only themselves
        and whose outputs are ignored. Node i of row r sits at r's valid column count + its depth."""
        device, n, length = self.valid.device, max(len(tree) for tree in trees), self.length
        tokens = torch.zeros(len(trees), n, dtype=torch.long, device=device)
        depths = torch.zeros(len(trees), n, dtype=torch.long, device=device)
        allowed = torch.zeros(len(trees), n, length + n, dtype=torch.bool, device=device)
        allowed[:, :, length:] = torch.eye(n, dtype=torch.bool, device=device)  # dummy nodes: themselves only
        for row, tree in enumerate(trees):
            tree = tree.to(device)
            k = len(tree)
            tokens[row, :k] = tree.input_tokens
            depths[row, :k] = tree.depths
            allowed[row, :k, : length + k] = tree.visibility(length, self.valid[row])
        positions = self.valid.sum(dim=1, keepdim=True) + depths
        return tokens, positions, additive_mask(allowed, dtype)[0, 0][:, None]

    def keep(self, cache: Cache, kept: list[list[int]]) -> None:
        """After a pass over trees appended at column L: row r keeps its nodes `kept[r]` (sorted; node 0, the root,
        first); they move to columns L, L + 1, ... and the columns up to the longest row's end become holes."""
        length = self.length
        end = keep_positions_per_row(cache, length, [[length + node for node in row] for row in kept])
        counts = torch.tensor([len(row) for row in kept]).to(self.valid.device)
        added = torch.arange(end - length, device=self.valid.device)[None, :] < counts[:, None]
        self.valid = torch.cat([self.valid, added], dim=1)

    def packed_order(self, rows: list[int], prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For batch rows `rows`: each one's column order that puts the columns holding its tokens first, in sequence
        order (the first `prompt` columns as they are, left pads included, then its valid columns: holes dropped),
        and how many those are `(R,)`. Computed on the device (no read): plain generate's layout of the row."""
        keep = self.valid[torch.tensor(rows, dtype=torch.long).to(self.valid.device)].clone()
        keep[:, :prompt] = True
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
        return order, keep.sum(dim=1)

    def select(self, cache: Cache | None, rows: list[int]) -> None:
        """Keep only batch rows `rows` (of this and of `cache`)."""
        if cache is not None:
            select_batch_rows(cache, rows)
        self.valid = self.valid[torch.tensor(rows, dtype=torch.long).to(self.valid.device)]
