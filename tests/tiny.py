"""The one tiny-model factory of the suite: random float32 models small enough to generate in milliseconds.

`tiny_model("llama", seed)` is what most tests use (`tests.conftest` re-exports it with its fixtures); a test that
needs another size changes config fields by keyword (`tiny_model("llama", 0, num_hidden_layers=6)`), and the model
families of `tests/families.py` are built by the same `build`. Models are sharpened (output layer scaled) so that
greedy paths vary and a draft that resembles the target agrees with it, and generate without an eos.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 64
SHARPEN = 8.0  # output-layer scale: peaked distributions, so a draft that is the target agrees with it
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
#: the architectures most tests run on (tiny_pair is parametrised over them): config class and fields
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(vocab_size=VOCAB, **SIZES, max_position_embeddings=512, **IDS)),
    "qwen2": ("Qwen2Config", dict(vocab_size=VOCAB, **SIZES, max_position_embeddings=512, **IDS)),
}


def tiny_config(arch: str = "llama", **changes: Any) -> transformers.PretrainedConfig:
    """The config of `tiny_model(arch)`, with `changes` applied (before the config derives head sizes from them)."""
    config_class, fields = TINY_CONFIGS[arch]
    return getattr(transformers, config_class)(**{**fields, **changes})


def build(
    config: transformers.PretrainedConfig,
    seed: int = 0,
    *,
    attn: str = "sdpa",
    sharpen: float = SHARPEN,
    model_class: type | None = None,
) -> torch.nn.Module:
    """A random model of `config` in eval mode, its output layer scaled by `sharpen` (untied first, so the
    input embeddings stay as initialised), generating without eos; the same weights for the same seed."""
    torch.manual_seed(seed)
    if model_class is not None:
        model = model_class._from_config(config, attn_implementation=attn)
    else:
        auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
        model = auto.from_config(config, attn_implementation=attn)
    model = model.float().eval()
    if sharpen != 1.0:
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:  # tied: sharpen the output layer alone
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        with torch.no_grad():
            head.weight.mul_(sharpen)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    *,
    attn: str = "sdpa",
    sharpen: float = SHARPEN,
    model_class: type | None = None,
    **changes: Any,
) -> torch.nn.Module:
    """A tiny random model of `arch` (a key of TINY_CONFIGS) with config `changes`, seeded by `seed`."""
    return build(tiny_config(arch, **changes), seed, attn=attn, sharpen=sharpen, model_class=model_class)


SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 64 ids: special tokens, then words "w7" ... "w63"."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
