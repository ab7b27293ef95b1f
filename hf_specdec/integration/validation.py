"""Refuse what the speculative loop cannot do, before anything runs, with the fix in the message."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, StaticCache

from ..accept.kv_cache import cache_length, dropped_rows, is_static, static_capacity
from ..core.model_inputs import TokenInputs, unplaceable_inputs
from ..core.releases import CACHE
from ..runtime.attention import AttentionLayout, check_supported, keeps_state
from ..runtime.model_info import vocabulary_mismatch
from ..runtime.ranks import Ranks
from ..verify import verifier_for
from .call import SpeculationCall


def check_speculation(
    model: PreTrainedModel,
    call: SpeculationCall,
    kwargs: dict[str, Any],
    config: GenerationConfig,
    model_kwargs: dict[str, Any],
) -> None:
    """Every refusal, before Transformers prepares anything: `config` and `model_kwargs` are the call's settings as
    `generate` will merge them (`_prepare_generation_config`), `kwargs` the call's own arguments."""
    check_call(model, call, kwargs)
    check_options(call, kwargs, config)
    rows = prompt_of(kwargs).shape[0] * (config.num_return_sequences or 1)
    if call.streamer is not None and rows > 1:  # Transformers' streamers take one sequence too (TextStreamer.put)
        raise ValueError(f"A streamer takes one sequence, and this call decodes {rows}: drop `streamer`, or generate "
                         "the prompts one at a time.")
    if rows > 1 and (refusal := call.config.batch_refusal()) is not None:
        raise batch_error(rows, *refusal)
    check_recurrent(model, call.assistant_model, config, model_kwargs, rows)
    check_generation_config(model, config, prompt_of(kwargs), model_kwargs)
    verifier_for(call.config, bool(config.do_sample))


def prompt_of(kwargs: dict[str, Any]) -> torch.Tensor:
    """The prompt's token ids as given; with none, Transformers starts from one BOS token (a batch of one)."""
    for name in ("inputs", "input_ids"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return torch.ones(1, 1, dtype=torch.long)


def check_call(model: PreTrainedModel, call: SpeculationCall, kwargs: dict[str, Any]) -> None:
    """Checks that need only the models and the call's arguments."""
    method = call.config.method
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"speculation={method!r} supports decoder-only models; {type(model).__name__} is an encoder-decoder. "
            "Drop `speculation` to use Transformers' own assisted generation for it."
        )
    chain = call.config.drafts_chains
    check_supported(model, "target", chain)
    check_attention_kernel(model, "target")
    draft = call.assistant_model
    if call.config.needs_assistant and draft is None:
        raise ValueError(
            f"speculation={method!r} drafts with a smaller model: pass `assistant_model=` (a causal LM sharing the "
            "target's tokenizer), or choose a method that needs none."
        )
    if draft is not None and not call.config.needs_assistant:
        raise ValueError(
            f"speculation={method!r} drafts without a model, so it would ignore assistant_model: drop "
            "`assistant_model`, or pick a method that drafts with it (e.g. 'tree', 'sequoia', 'specexec')."
        )
    if draft is not None:
        if draft.config.is_encoder_decoder:
            raise ValueError("The assistant_model must be a decoder-only causal LM.")
        check_supported(draft, "assistant_model", chain)
        check_attention_kernel(draft, "assistant_model")
        tokenizer = kwargs.get("tokenizer")
        mismatch = vocabulary_mismatch(model, draft, len(tokenizer) if tokenizer is not None else None)
        if mismatch is not None:
            raise ValueError(
                f"The assistant_model's vocabulary differs from the target's: {mismatch}. Speculation needs both "
                "models to share one tokenizer: pick a draft from the target's family, or pass `tokenizer=` so "
                "the output layers are checked against its vocabulary."
            )
    if dropped_rows(kwargs.get(CACHE)):
        raise ValueError(
            "The cache passed has sliding-window layers that already dropped their oldest rows, and "
            "speculation must keep every row to compact the cache: pass a DynamicCache() built without a config "
            "(speculation applies the window itself), or no cache."
        )
    if kwargs.get("assistant_tokenizer") is not None or kwargs.get("prompt_lookup_num_tokens") is not None:
        raise ValueError(
            "`speculation` replaces assistant_tokenizer / prompt_lookup_num_tokens: pass only one of them."
        )
    check_assisted_settings(method, kwargs)
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "Speculation drafts from token ids, so it cannot start from `inputs_embeds`: pass the prompt as "
            "`input_ids` (without inputs_embeds), or drop `speculation`."
        )
    if kwargs.get("synced_gpus"):
        raise ValueError(
            "Speculation runs one process's decoding loop and cannot keep GPUs in step (synced_gpus=True, for "
            "DeepSpeed ZeRO-3 / FSDP): drop synced_gpus, or drop `speculation`."
        )


#: Transformers' settings of its own assisted generation (read there from the assistant's generation config): the
#: method that has its own setting for it and that setting (`{value}` filled in), or None where no method has one
ASSISTED_SETTINGS: dict[str, tuple[str | None, str]] = {
    "num_assistant_tokens": ("chain", "speculation_config={{'num_draft_tokens': {value}}}"),
    "assistant_confidence_threshold": ("chain", "speculation_config={{'confidence_threshold': {value}}}"),
    "num_assistant_tokens_schedule": (None, ""),
    "assistant_lookbehind": (None, ""),
    "target_lookbehind": (None, ""),
    "max_matching_ngram_size": ("prompt_lookup", "speculation_config={{'max_ngram': {value}}}"),
    "assistant_early_exit": (None, ""),
}


def check_assisted_settings(method: str, kwargs: dict[str, Any]) -> None:
    """Refuse Transformers' assisted-generation settings passed to a speculative call: the method never reads
    them, so they would be dropped silently; the message names the method's own setting where it has one."""
    for name, (owner, setting) in ASSISTED_SETTINGS.items():
        if kwargs.get(name) is None:
            continue
        value = kwargs[name]
        if owner == method:
            fix = f"pass {setting.format(value=repr(value))} instead"
        elif owner is not None:
            fix = f"drop it (speculation={owner!r} takes it as {setting.format(value=repr(value))})"
        else:
            fix = "drop it"
        raise ValueError(
            f"{name}={value!r} sets Transformers' own assisted generation, which speculation={method!r} replaces "
            f"and would ignore: {fix}, or drop `speculation` to use Transformers' assisted generation."
        )


def check_attention_kernel(model: PreTrainedModel, role: str) -> None:
    """Refuse flash-attention kernels: Transformers hands them the 4-D tree mask as a padding mask and takes tree
    position ids for packed sequences, so every drafted node would attend to the wrong keys."""
    kernel = str(getattr(model.config, "_attn_implementation", None) or "")
    if "flash" in kernel.lower():
        raise ValueError(
            f"The {role} {type(model).__name__} runs attn_implementation={kernel!r}, which cannot take a tree "
            "attention mask (flash-attention reads a 4-D mask as padding and tree position ids as packed sequences): "
            "load it with attn_implementation='sdpa' (or 'eager'), e.g. `model.set_attn_implementation('sdpa')`, or "
            "drop `speculation`."
        )


def check_recurrent(model: PreTrainedModel, draft: PreTrainedModel | None, config: GenerationConfig,
                    model_kwargs: dict[str, Any], rows: int) -> None:
    """What a chain on a model with recurrent state (`core.attention.unsupported_reason`) cannot do yet, by name."""
    stateful = [role for role, m in (("target", model), ("assistant_model", draft)) if m is not None and keeps_state(m)]
    if not stateful:
        return
    which = f"the {' and the '.join(stateful)} keep{'s' if len(stateful) == 1 else ''} a recurrent state"
    cache = model_kwargs.get(CACHE)
    if rows > 1:
        raise batch_error(rows, f"models with recurrent state ({which})", "drop `speculation` for them")
    if config.cache_implementation == "static" or is_static(cache):
        raise ValueError(f"Speculation rolls a recurrent state back on a dynamic cache only, and {which}: drop "
                         "cache_implementation='static' (or the StaticCache passed), or drop `speculation`.")
    if cache_length(cache) > 0 and "target" in stateful:
        raise ValueError(f"Speculation on a model with recurrent state starts from an empty cache, and {which}: drop "
                         f"the filled `{CACHE}=` (pass the whole conversation as input_ids), or drop `speculation`.")
    asked = [name for name in ("output_hidden_states", "output_attentions") if getattr(config, name, False)]
    if config.return_dict_in_generate and asked and "target" in stateful:
        raise ValueError(f"Speculation does not return {' or '.join(asked)} of a model with recurrent state ({which}): "
                         f"drop {' and '.join(asked)}, or drop `speculation`.")


def check_options(call: SpeculationCall, kwargs: dict[str, Any], config: GenerationConfig) -> None:
    """Generate options the speculative loop cannot honour exactly, or that need what the call lacks."""
    if config.is_assistant:  # its generation config is the target's copy, stored `speculation` included
        raise ValueError("This is the draft's call inside Transformers' own assisted generation: it runs plainly.")
    if config.prefill_chunk_size is not None:
        raise ValueError(
            f"speculation runs the prompt in one pass, so it cannot honour prefill_chunk_size="
            f"{config.prefill_chunk_size}: drop prefill_chunk_size, or drop `speculation`."
        )
    for option, value in (("stop_strings", config.stop_strings), ("token_healing", config.token_healing)):
        if value and call.tokenizer is None:
            raise ValueError(
                f"{option} needs the model's tokenizer: pass `tokenizer=` to generate (or drop {option})."
            )
    if config.token_healing and kwargs.get("inputs") is None and kwargs.get("input_ids") is None:
        raise ValueError("token_healing heals the end of a prompt: pass the prompt's token ids as `input_ids`.")


def check_generation_config(
    model: PreTrainedModel, config: GenerationConfig, input_ids: torch.Tensor, model_kwargs: dict[str, Any]
) -> None:
    """Checks that need the merged generation config and the prepared inputs."""
    if input_ids.shape[1] == 0:
        raise ValueError("Speculation needs a non-empty `input_ids` prompt (inputs_embeds alone are not supported).")
    if (config.num_beams or 1) > 1:
        raise ValueError("Speculation cannot be combined with beam search: set num_beams=1 or drop `speculation`.")
    rows = input_ids.shape[0] * (config.num_return_sequences or 1)
    if rows > 1:
        check_batch(model, config, input_ids, model_kwargs, rows)
    cache = model_kwargs.get(CACHE)
    check_cache(config, input_ids, cache)
    if cache is not None and config.use_cache is False:
        raise ValueError(
            f"use_cache=False with a cache passed ({CACHE}=): speculation always decodes with a KV cache and would "
            "fill yours (plain generate would re-feed the whole sequence into it every step). Drop use_cache=False, "
            f"or drop {CACHE}."
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and rows == 1 and not bool((mask == 1).all()):
        raise ValueError(padding_message(mask, input_ids, config.pad_token_id))
    check_model_inputs(model, input_ids, model_kwargs)


def batch_error(rows: int, what: str, fix: str) -> ValueError:
    """The one wording of what a batch cannot do yet, with its fix."""
    return ValueError(f"Speculation on a batch ({rows} sequences) does not support {what} yet: {fix}, or generate "
                      "the prompts one at a time.")


CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
#: output records a batch does not return yet (per-token records of ragged rows)
BATCH_RECORDS = ("output_scores", "output_logits", "output_hidden_states", "output_attentions")


def check_batch(
    model: PreTrainedModel, config: GenerationConfig, input_ids: torch.Tensor, model_kwargs: dict[str, Any], rows: int
) -> None:
    """What a batch (`rows` > 1 sequences: several prompts, or num_return_sequences copies) cannot do yet, refused
    by name; and its padding must be on the left, as tokenizers pad for decoder-only models."""
    def refuse(what: str, fix: str) -> ValueError:
        return batch_error(rows, what, fix)

    cache = model_kwargs.get(CACHE)  # generate's own is an empty DynamicCache
    if is_static(cache) or cache_length(cache) > 0 or config.cache_implementation == "static":
        raise refuse(f"a filled cache ({CACHE}=) or a static cache (its rows would be left with holes)",
                     f"drop {CACHE} / cache_implementation")
    if config.return_dict_in_generate:
        asked = [name for name in BATCH_RECORDS if getattr(config, name, False)]
        if asked:
            raise refuse(", ".join(asked), f"drop {' and '.join(asked)} (speculation_stats come per row)")
    if config.token_healing:
        raise refuse("token_healing", "drop token_healing")
    if AttentionLayout.of(model).window is not None:
        raise refuse(f"sliding-window attention ({type(model).__name__})", "drop `speculation` for this model")
    if TokenInputs.of(model, input_ids, model_kwargs).prompt:
        raise refuse("token type inputs", "drop token_type_ids")
    if Ranks.of(model).shared:
        raise refuse("a target sharded over tensor-parallel ranks", "drop `speculation` for this model")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.shape == input_ids.shape:
        mask = mask.long()
        left_padded = bool(((mask == 0) | (mask == 1)).all() and (mask[:, 1:] >= mask[:, :-1]).all()
                           and (mask[:, -1] == 1).all())
        if not left_padded:
            raise ValueError(
                "Speculation on a batch needs left padding (attention_mask zeros only before each row's prompt, as "
                "tokenizers pad decoder-only models with padding_side='left'): set tokenizer.padding_side = 'left' "
                "and tokenize again."
            )


def check_cache(config: GenerationConfig, input_ids: torch.Tensor, cache: Any) -> None:
    """A cache speculation can compact in place (a DynamicCache, or a StaticCache with room for the whole call)."""
    if config.cache_implementation not in CACHE_IMPLEMENTATIONS or (
        cache is not None and type(cache) not in (DynamicCache, StaticCache)
    ):
        given = (f"cache_implementation={config.cache_implementation!r}" if cache is None
                 else f"a {type(cache).__name__} as {CACHE}")
        raise ValueError(
            f"Speculation compacts the KV cache to the accepted path in place, which it can do in a DynamicCache or a "
            f"StaticCache, not with {given}: use cache_implementation='dynamic' or 'static' (or pass a DynamicCache "
            "/ StaticCache), or drop `speculation`."
        )
    static = config.cache_implementation == "static" or isinstance(cache, StaticCache)
    if static and config.output_attentions and config.return_dict_in_generate:
        raise ValueError(
            "Speculation returns attentions over the accepted tokens' key columns, while plain generate on a static "
            "cache returns rows as wide as the cache: drop output_attentions, or use cache_implementation='dynamic' "
            "(or drop `speculation`)."
        )
    rows = static_capacity(cache) if cache is not None else None
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - input_ids.shape[1]
    needed = input_ids.shape[1] + new - 1  # the cache holds every token but the last, as in plain generate
    if rows is not None and rows < needed:
        raise ValueError(
            f"The StaticCache passed holds max_cache_len={rows} tokens, but the prompt ({input_ids.shape[1]}) and "
            f"max_new_tokens ({new}) need {needed} (plain generate would fail once it is full): build it with "
            f"max_cache_len >= {needed}, or ask for fewer new tokens. Rows beyond that let the last trees stay whole "
            "(speculation cuts a tree to the rows left)."
        )


def padding_message(mask: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int | None) -> str:
    """Why a prompt counts as padded: Transformers masks every `pad_token_id` in a prompt passed without a mask."""
    masked = torch.nonzero(mask[0] != 1).flatten().tolist()
    at = f"position{'s' if len(masked) > 1 else ''} {masked[:8]}{' ...' if len(masked) > 8 else ''}"
    if pad_token_id is not None and masked and mask.shape == input_ids.shape and bool(
        (input_ids[0, masked] == pad_token_id).all()
    ):
        return (
            f"Speculation does not support padded inputs, and the prompt holds pad_token_id={pad_token_id} at {at}, "
            "which the attention mask leaves out. If those tokens are text, pass attention_mask=torch.ones_like("
            "input_ids) (or set another pad_token_id); if they are padding, pass the prompt without them."
        )
    return (f"Speculation does not support padded inputs: the attention_mask is 0 at {at}. Pass the prompt without "
            "padding tokens, with an all-ones attention_mask or none.")


def check_model_inputs(model: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> None:
    """Every model input reaches every pass as plain `generate` gives it, or is refused here (`core.model_inputs`)."""
    positions = model_kwargs.get("position_ids")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.shape == input_ids.shape:  # what generate derives from a padded batch's mask
        plain = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0).cpu()
    else:
        plain = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
    if positions is not None and not torch.equal(positions.cpu().expand_as(plain), plain):
        raise ValueError(
            "Speculation places every new token at the position after the last one, so custom `position_ids` "
            "cannot be honoured: drop position_ids (the prompt's are then 0, 1, ...), or drop `speculation`."
        )
    unplaceable = unplaceable_inputs(model, input_ids, model_kwargs)
    if unplaceable:
        raise ValueError(
            f"{type(model).__name__} takes {', '.join(unplaceable)} at every decoding pass, and speculation can place "
            "only token types on the nodes of a tree, so the output would differ from plain generate: drop "
            f"{' and '.join(unplaceable)}, or drop `speculation`."
        )


# Processors whose output depends on more than (this sequence's tokens, these scores): they keep state across calls
# (a cache of their own, a call counter) or rely on the batch layout, so they cannot be asked about tree nodes one
# prefix at a time. Every other processor, custom ones included, must honour the LogitsProcessor contract: a pure
# function of `input_ids` and `scores`.
PER_NODE_UNSAFE_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it runs its own model with a private KV cache",
    "ClassifierFreeGuidanceLogitsProcessor": "it expects a doubled batch (conditional and unconditional rows)",
    "SynthIDTextWatermarkLogitsProcessor": "it keeps a running context and a call counter",
    "WhisperTimeStampLogitsProcessor": "it is written for Whisper's decoding loop",
    "WhisperNoSpeechDetection": "it is written for Whisper's decoding loop",
    "AlternatingCodebooksLogitsProcessor": "it is written for Bark's codebook loop",
    "DiaClassifierFreeGuidanceLogitsProcessor": "it expects a doubled batch",
    "DiaEOSChannelFilterLogitsProcessor": "it is written for Dia's delay pattern",
    "DiaEOSDelayPatternLogitsProcessor": "it keeps a delay pattern across calls",
}


def check_processors(processors) -> None:
    """Refuse processors that cannot be applied to each tree node with that node's own prefix."""
    for processor in processors or []:
        reason = PER_NODE_UNSAFE_PROCESSORS.get(type(processor).__name__)
        if reason is not None:
            raise ValueError(
                f"Speculation applies every logits processor to each drafted token with that token's own prefix, but "
                f"{type(processor).__name__} cannot be used that way: {reason}. Drop it (or the setting that adds it, "
                "e.g. guidance_scale / watermarking_config), or drop `speculation`."
            )
