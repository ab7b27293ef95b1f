"""A captured step's drafted tree (decoding/captured.py): device tensors of fixed shapes, whatever drafted it.

A planned shape (`chain`, `tree`, `sequoia`) knows its parents before the step and keeps them as buffers; a tree grown
best first on the device (`specexec`, methods/specexec/captured_growth.py) learns them during the step. Either way
the target's pass, the verdict and both caches' compaction read only this."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.pass_shapes import PaddedTree

CATCH_UP = 2  # rows of the draft's catch-up pass: the last step's unforwarded accepted leaf (if any) and its bonus


@dataclass(frozen=True)
class DraftedTree:
    """`n` drafted nodes, the root first; on the target's device unless said."""

    tokens: torch.Tensor  # (n,) long: -1 where the draft filled no token (never kept)
    parents: torch.Tensor  # (n,) long: the root's 0 (its own parent, kept by construction)
    depths: torch.Tensor  # (n,) long
    ancestors: torch.Tensor  # (n, n) bool: a node its own ancestor
    target_rows: PaddedTree  # the target's pass over the nodes (padded)
    slots: torch.Tensor  # (n,) long on the draft's device: each node's row among the forwarded ones (0 if never)
    forwarded: torch.Tensor  # (n,) bool on the draft's device: the draft forwarded the node (it has children)
    drawn_from: torch.Tensor | None = None  # (n, V) the draft's distributions children were drawn from (sampled)
    learned: torch.Tensor | None = None  # long, on the target's device: what the host learns from, read with the step
