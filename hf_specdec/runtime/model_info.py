"""Facts about a model that every layer asks for."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

#: Models of one family may pad their output layers to different sizes around one tokenizer (Qwen2.5: 151,936
#: rows up to 3B, 152,064 from 7B, for 151,665 tokens). Without a tokenizer to compare, two models of one
#: `model_type` whose row counts differ by at most this many rows are taken to differ by padding only.
MAX_PADDING_ROWS = 1024


def vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output layer (padded vocabularies count), whatever kind of Linear it is (quantized too)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    if size is None and isinstance(getattr(head, "weight", None), torch.Tensor):
        size = head.weight.shape[0]
    return int(size) if size is not None else int(model.config.get_text_config().vocab_size)


def quantization(model: PreTrainedModel) -> str | None:
    """How the model's weights are quantized ("torchao:Int8WeightOnlyConfig", "quanto:int8", "dynamic-int8"), or
    None for plain floating-point weights; a draft whose output layer covers a subset of the vocabulary says so
    ("dynamic-int8, vocabulary 32768"). Such a model's passes cost differently: its latency curves and plans are its
    own."""
    weights = _weights_quantization(model)
    subset = getattr(model.config, "hf_specdec_vocabulary", None)
    if subset is None:
        return weights
    return f"{weights or 'float'}, vocabulary {subset}"


def _weights_quantization(model: PreTrainedModel) -> str | None:
    ours = getattr(model.config, "hf_specdec_quantization", None)
    if ours is not None:
        return str(ours)
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    method = str(config.get("quant_method", "unknown")).removeprefix("QuantizationMethod.").lower()
    if config.get("dequantize"):  # GGUF unpacked at load time: plain weights
        return None
    bits_and_bytes = "4bit" if config.get("load_in_4bit") else "8bit" if config.get("load_in_8bit") else None
    detail = config.get("quant_type") or config.get("weights") or config.get("bits") or bits_and_bytes
    if isinstance(detail, dict):  # torchao writes {"default": {"_type": "Int8WeightOnlyConfig", ...}}
        inner = detail.get("default", detail)
        detail = inner.get("_type", "") if isinstance(inner, dict) else inner
    return f"{method}:{detail}" if detail else method


def vocabulary_mismatch(
    target: PreTrainedModel, draft: PreTrainedModel, tokenizer_size: int | None = None
) -> str | None:
    """Why `draft`'s token ids may not mean what `target`'s do, or None when they share one vocabulary.

    What matters is the tokenizer: with its size known, both output layers must cover it (rows past it are
    padding). Without it: equal row counts, or one `model_type` and at most `MAX_PADDING_ROWS` rows apart.
    Rows only one model has are tokens the draft never proposes (see `fit_vocabulary`).
    """
    target_rows, draft_rows = vocab_size(target), vocab_size(draft)
    if target_rows == draft_rows:
        return None
    rows = f"the draft's output layer has {draft_rows} rows and the target's {target_rows}"
    if tokenizer_size is not None:
        if min(target_rows, draft_rows) >= tokenizer_size:
            return None
        return f"{rows}, fewer than the tokenizer's {tokenizer_size} tokens"
    types = (draft.config.model_type, target.config.model_type)
    if types[0] == types[1] and abs(target_rows - draft_rows) <= MAX_PADDING_ROWS:
        return None
    return (
        f"{rows} (model types {types[0]!r} and {types[1]!r}); without a tokenizer to compare, rows are taken as "
        f"padding only for models of one model_type at most {MAX_PADDING_ROWS} rows apart"
    )


def fit_vocabulary(logits: torch.Tensor, size: int | None) -> torch.Tensor:
    """Draft `logits` `(..., rows)` over the target's `size` rows: rows the target lacks are dropped (never
    proposed, never fed to it), rows the draft lacks get -inf (probability 0: never proposed). None: as is."""
    rows = logits.shape[-1]
    if size is None or size == rows:
        return logits
    if size < rows:
        return logits[..., :size]
    return torch.nn.functional.pad(logits, (0, size - rows), value=float("-inf"))


def embeddable(ids: torch.Tensor, rows: int | None) -> torch.Tensor:
    """`ids` with tokens past a model's `rows` input embeddings (the target's padding rows) replaced by its last
    row: any stand-in keeps the output lossless, since the draft only proposes and the target decides."""
    return ids.clamp(max=rows - 1) if rows is not None else ids  # a clamp, not a check: no device read
