"""Facts about a model that every layer asks for."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output layer (padded vocabularies count), whatever kind of Linear it is (quantized too)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    if size is None and isinstance(getattr(head, "weight", None), torch.Tensor):
        size = head.weight.shape[0]
    return int(size) if size is not None else int(model.config.get_text_config().vocab_size)
