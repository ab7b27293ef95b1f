"""A draft model and its KV cache across steps: the one place drafters run a model.

Cache layout: the committed tokens (a prefix of the sequence, its last token the next tree's root), then the
tree nodes forwarded while proposing the current tree, one slot each. `sync` brings the committed part up to
date with a new context and returns the root's logits; `forward_nodes` appends nodes with tree attention (each
sees the committed tokens, the earlier slots it is told to see, and itself); `commit` keeps the slots of the
accepted path and drops every other node. No model ever re-reads a token it has already seen.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from ..decoding.cache import keep_positions
from ..devices import execution_device


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output layer (padded vocabularies count), whatever kind of Linear it is (quantized too)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    if size is None and isinstance(getattr(head, "weight", None), torch.Tensor):
        size = head.weight.shape[0]
    return int(size) if size is not None else int(model.config.get_text_config().vocab_size)


class DraftModelCounts:
    """For drafters that run a model through `self.runner`: the loop's pass counter and timer read from it."""

    runner: DraftModelRunner

    @property
    def forward_count(self) -> int:
        return self.runner.forward_count

    @property
    def forward_time(self) -> float:
        return self.runner.forward_time


class DraftModelRunner:
    """Runs `model` over committed tokens and tree nodes, keeping its KV cache between steps."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.committed = torch.empty(0, dtype=torch.long)  # token id at each committed cache position
        self.num_nodes = 0  # tree-node slots after the committed positions
        self.forward_count = 0
        self.forward_time = 0.0
        self.device = execution_device(model)  # where inputs go: accelerate's execution device if offloaded

    def _forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0, **kwargs: torch.Tensor) -> torch.Tensor:
        """float32 CPU logits of one pass over `input_ids` `(len,)`: all rows, or the last `logits_to_keep` if > 0."""
        start = time.perf_counter()
        device = self.device
        with torch.no_grad():
            out = self.model(
                input_ids=input_ids[None].to(device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{name: value.to(device) for name, value in kwargs.items()},
            )
        logits = out.logits[0].float().cpu()
        self.forward_count += 1
        self.forward_time += time.perf_counter() - start
        return logits

    def sync(self, ids: torch.Tensor) -> torch.Tensor:
        """Make the committed part equal `ids` `(L,)`, feeding what the cache lacks; the logits `(vocab,)` of `ids[-1]`.

        Keeps the longest common prefix (minus at least the last token, whose logits are needed), so a context
        that diverged (a new prompt, a rejected draft) costs one pass over the new tokens only.
        """
        ids = ids.cpu()
        n = min(len(self.committed), len(ids) - 1)
        common = int((self.committed[:n] == ids[:n]).long().cumprod(0).sum()) if n else 0
        keep_positions(self.cache, common, [])
        self.num_nodes = 0
        logits = self._forward(ids[common:], logits_to_keep=1)
        self.committed = ids.clone()
        return logits[-1]

    def forward_nodes(self, tokens: torch.Tensor, depths: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """Forward tree nodes in one pass; their logits `(k, vocab)`. They take the next k slots.

        `tokens` and `depths` are `(k,)` (depth 1 = a child of the root, the last committed token); `sees` is a
        `(k, num_nodes)` bool matrix: which earlier slots (the node's forwarded ancestors) each node attends to.
        """
        k, past = len(tokens), len(self.committed)
        allowed = torch.ones(k, past + self.num_nodes + k, dtype=torch.bool)
        allowed[:, past : past + self.num_nodes] = sees
        allowed[:, past + self.num_nodes :] = torch.eye(k, dtype=torch.bool)
        dtype = self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        logits = self._forward(tokens, attention_mask=mask[None, None], position_ids=(past - 1 + depths)[None])
        self.num_nodes += k
        return logits

    def commit(self, ids: torch.Tensor, slots: list[int] | torch.Tensor) -> None:
        """`ids` `(L,)` is the new context; `slots` are the forwarded nodes of its accepted path, root side first.

        Those slots become committed positions; every other node is dropped.
        """
        past = len(self.committed)
        keep_positions(self.cache, past, [past + int(s) for s in slots])
        self.committed = ids[: past + len(slots)].cpu().clone()
        self.num_nodes = 0


def forwarded_prefix(slots: torch.Tensor) -> torch.Tensor:
    """The leading run of `slots` that are >= 0: the part of an accepted path the draft already forwarded."""
    return slots[: int((slots >= 0).long().cumprod(0).sum())]
