"""Models whose vocabulary is padded past the tokenizer's."""

from __future__ import annotations

import copy

import torch

from hf_specdec.runtime.model_info import vocab_size


def padded(model, rows: int):
    """A copy of `model` with `rows` token rows. Added output rows copy the strongest rows, doubled: a draft that
    proposed them would propose them often (and crash the target's embedding)."""
    out = copy.deepcopy(model)
    old = vocab_size(model)
    out.resize_token_embeddings(rows, mean_resizing=False)
    if rows > old:
        with torch.no_grad():
            out.lm_head.weight[old:] = 2.0 * model.lm_head.weight[3 + torch.arange(rows - old) % (old - 3)]
    return out
