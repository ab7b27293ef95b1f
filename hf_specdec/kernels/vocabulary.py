"""A draft whose output layer covers only the tokens it is likely to propose (FR-Spec, arXiv 2502.14856).

A small draft spends much of each pass in its output layer: Qwen2.5-0.5B's is 136 M of its 494 M weights, one row
per vocabulary entry, though text uses a small part of the vocabulary. Restricting the layer to the most frequent
tokens makes every draft pass cheaper. It stays lossless by construction: only the draft changes, and a token
outside the subset simply gets probability zero from it (logits -inf), so it is never proposed; the target still
decides every token, greedy or sampled, from its own full distribution. The layer still returns logits over the
whole vocabulary, so every caller (our drafters, Transformers' assisted generation) sees the usual shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel


class SubsetHead(torch.nn.Module):
    """An output layer over `token_ids` only, returning logits over all `out_features` rows (-inf elsewhere)."""

    def __init__(self, head: torch.nn.Linear, token_ids: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=head.weight.device).unique()
        self.proj = torch.nn.Linear(self.in_features, len(ids), bias=head.bias is not None,
                                    dtype=head.weight.dtype, device=head.weight.device)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight[ids])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias[ids])
        self.register_buffer("token_ids", ids, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.proj(hidden)
        logits = kept.new_full((*kept.shape[:-1], self.out_features), float("-inf"))
        return logits.index_copy_(-1, self.token_ids, kept)


def restrict_vocabulary(model: PreTrainedModel, token_ids: Sequence[int] | torch.Tensor) -> PreTrainedModel:
    """Give draft `model` an output layer over `token_ids` only, in place (see `frequent_tokens`); returns it.

    For drafts only: a target restricted this way would change the output. The input embeddings stay whole (the
    draft still reads every token), and tied weights are untied (the layer keeps a copy of its rows).
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(
            f"restrict_vocabulary needs the model's output layer to be a torch.nn.Linear, not {type(head).__name__}: "
            "restrict the vocabulary before quantizing (quantize_draft(model, vocabulary=...) does both in order)."
        )
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= head.out_features:
        raise ValueError(f"token_ids must be non-empty ids below the output layer's {head.out_features} rows.")
    model.set_output_embeddings(SubsetHead(head, ids))
    model.config.tie_word_embeddings = False  # the subset is a copy: nothing may tie it back to the embeddings
    model.config.hf_specdec_vocabulary = int(ids.unique().numel())
    return model


def frequent_tokens(tokenizer, texts: Iterable[str], size: int) -> torch.Tensor:
    """The `size` token ids that occur most often in `texts` (tokenized by `tokenizer`), plus every special token
    (end of text, chat markers), sorted: what a draft needs to propose in text like `texts`."""
    counts = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    frequent = [token for token, _ in counts.most_common(size)]
    return torch.tensor(sorted({*frequent, *tokenizer.all_special_ids}), dtype=torch.long)
