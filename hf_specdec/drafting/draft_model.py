"""A draft model and its KV cache across steps: the one place drafters run a model.

Cache layout: the committed tokens (a prefix of the sequence, its last token the next tree's root), then the
tree nodes forwarded while proposing the current tree, one slot each. `forward_tree` appends nodes with tree
attention (each sees the committed tokens, the earlier slots and in-pass nodes it is told to see, and itself) and,
given the new context, first brings the committed part up to date in the same pass; `sync` is that catch-up alone
(it returns the root's logits); `commit` keeps the slots of the accepted path and drops every other node. No model
ever re-reads a token it has already seen.

The cache keeps every row (no sliding-window layers: compaction moves rows) and remembers each node slot's position,
so sliding-window layers get their window by position in the masks (`core.attention`).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from ..core.attention import AttentionLayout
from ..core.devices import execution_device
from ..core.kv_cache import keep_positions
from ..core.model_info import embeddable, fit_vocabulary
from ..core.model_inputs import TokenInputs, explicit_parameters


class DraftModelCounts:
    """For drafters that run a model through `self.runner`: the loop's pass counter and timer read from it."""

    runner: DraftModelRunner

    @property
    def forward_count(self) -> int:
        return self.runner.forward_count

    @property
    def forward_time(self) -> float:
        return self.runner.forward_time

    def use_inputs(self, inputs: TokenInputs) -> None:
        self.runner.token_inputs = inputs.for_model(self.runner.model)


class DraftModelRunner:
    """Runs `model` over committed tokens and tree nodes, keeping its KV cache between steps.

    With `vocab` (the target's output rows), logits come over the target's vocabulary (`fit_vocabulary`), and ids
    the draft cannot embed are fed as a stand-in (`embeddable`): pairs whose vocabularies differ by padding work.
    """

    def __init__(self, model: PreTrainedModel, vocab: int | None = None) -> None:
        self.model = model
        self.vocab = vocab
        self.input_rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
        self.layout = AttentionLayout.of(model)
        self.cache = DynamicCache()  # full-length layers, whatever the model's window
        self.committed = torch.empty(0, dtype=torch.long)  # token id at each committed cache position
        self.num_nodes = 0  # tree-node slots after the committed positions
        self.node_positions = torch.empty(0, dtype=torch.long)  # position of each tree-node slot
        self.forward_count = 0
        self.forward_time = 0.0
        self.device = execution_device(model)  # where inputs go: accelerate's execution device if offloaded
        self.token_inputs = TokenInputs()  # the call's token types, placed by position (`use_inputs`)
        self.keeps_logits = "logits_to_keep" in explicit_parameters(model)  # else the runner slices them itself

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0, **kwargs: torch.Tensor
    ) -> torch.Tensor:
        """float32 CPU logits of one pass over `input_ids` `(len,)` at `positions`: all rows, or the last
        `logits_to_keep` if > 0."""
        start = time.perf_counter()
        device = self.device
        kept = {"logits_to_keep": logits_to_keep} if self.keeps_logits else {}
        with torch.no_grad():
            out = self.model(
                input_ids=embeddable(input_ids, self.input_rows)[None].to(device),
                position_ids=self.layout.model_positions(positions)[None].to(device),
                past_key_values=self.cache,
                use_cache=True,
                **self.token_inputs.at(positions, device),
                **{name: _to(value, device) for name, value in kwargs.items()},
                **kept,
            )
        logits = out.logits[0, -logits_to_keep:] if logits_to_keep else out.logits[0]
        logits = fit_vocabulary(logits.float().cpu(), self.vocab)
        self.forward_count += 1
        self.forward_time += time.perf_counter() - start
        return logits

    def _catch_up(self, ids: torch.Tensor) -> torch.Tensor:
        """Drop tree slots and the committed tokens `ids` `(L,)` does not share; the tokens still to feed.

        Keeps the longest common prefix (minus at least the last token, whose logits are needed), so a context
        that diverged (a new prompt, a rejected draft) costs one pass over the new tokens only.
        """
        n = min(len(self.committed), len(ids) - 1)
        common = int((self.committed[:n] == ids[:n]).long().cumprod(0).sum()) if n else 0
        keep_positions(self.cache, common, [])
        self.committed, self.num_nodes = ids[:common], 0
        self.node_positions = self.node_positions[:0]
        return ids[common:]

    def sync(self, ids: torch.Tensor) -> torch.Tensor:
        """Make the committed part equal `ids` `(L,)`, feeding only what the cache lacks; the logits of ids[-1]."""
        empty = torch.empty(0, dtype=torch.long)
        root_logits, _ = self.forward_tree(empty, empty, torch.empty(0, 0, dtype=torch.bool), ids)
        return root_logits

    def forward_tree(
        self, tokens: torch.Tensor, depths: torch.Tensor, sees: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One pass over `k` tree nodes; with `ids`, first make the committed part equal `ids` in the same pass.

        `tokens`, `depths` are `(k,)` (depth 1 = a child of the root, the last committed token); `sees` is
        `(k, num_nodes + k)` bool: each node's forwarded ancestors among the earlier slots *and* among this pass's
        nodes (a node always sees itself). With `ids`, earlier slots are dropped first (num_nodes = 0). The nodes
        take the next k slots. Returns the logits of `ids[-1]` (None without `ids`) and the nodes' logits `(k, vocab)`.
        """
        fresh = self._catch_up(ids.cpu()) if ids is not None else torch.empty(0, dtype=torch.long)
        past, old, m, k = len(self.committed), self.num_nodes, len(fresh), len(tokens)
        positions = torch.cat([torch.arange(past, past + m), past + m - 1 + depths])
        if k == 0:  # catching up only: a plain causal pass (the model applies any window), the last row's logits
            logits = self._forward(fresh, positions, logits_to_keep=1)
        else:
            allowed = torch.zeros(m + k, past + old + m + k, dtype=torch.bool)
            allowed[:, :past] = True
            allowed[:m, past : past + m] = torch.ones(m, m, dtype=torch.bool).tril()  # old == 0 when m > 0
            allowed[m:, past + old : past + old + m] = True
            allowed[m:, past : past + old] = sees[:, :old]
            allowed[m:, past + old + m :] = sees[:, old:] | torch.eye(k, dtype=torch.bool)
            keys = torch.cat([torch.arange(past), self.node_positions, positions])
            mask = self.layout.masks(allowed, positions, keys, self.model.dtype, self.device)
            logits = self._forward(torch.cat([fresh, tokens]), positions, logits_to_keep=k + (1 if m else 0),
                                   attention_mask=mask)
        if ids is not None:
            self.committed = ids.cpu().clone()
        self.num_nodes = old + k
        self.node_positions = torch.cat([self.node_positions, positions[m:]])
        return (logits[0] if m else None), logits[len(logits) - k :]

    def commit(self, ids: torch.Tensor, slots: list[int] | torch.Tensor) -> None:
        """`ids` `(L,)` is the new context; `slots` are the forwarded nodes of its accepted path, root side first.

        Those slots become committed positions; every other node is dropped.
        """
        past = len(self.committed)
        keep_positions(self.cache, past, [past + int(s) for s in slots])
        self.committed = ids[: past + len(slots)].cpu().clone()
        self.num_nodes = 0
        self.node_positions = self.node_positions[:0]


def _to(value: torch.Tensor | dict[str, torch.Tensor], device: torch.device):
    """A tensor, or a dict of masks by layer type, on `device`."""
    if isinstance(value, dict):
        return {name: mask.to(device) for name, mask in value.items()}
    return value.to(device)


def forwarded_prefix(slots: torch.Tensor) -> torch.Tensor:
    """The leading run of `slots` that are >= 0: the part of an accepted path the draft already forwarded."""
    return slots[: int((slots >= 0).long().cumprod(0).sum())]
