"""Bad input: a clear error naming the problem and the fix, and nothing changed behind."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    SynthIDTextWatermarkingConfig,
    T5Config,
    T5ForConditionalGeneration,
)

import hf_specdec
from hf_specdec.core.releases import cache_arg
from hf_specdec.runtime.model_info import MAX_PADDING_ROWS
from tests.conftest import VOCAB, random_prompt, tiny_model


def _ids(length: int = 5, batch: int = 1) -> torch.LongTensor:
    return torch.cat([random_prompt(torch.Generator().manual_seed(i), length) for i in range(batch)])


def _state(model) -> tuple:
    """What a refusal must leave as it was: the model's attributes and generation config, Transformers' patches."""
    return (
        sorted(vars(model)),
        copy.deepcopy(model.generation_config.to_dict()),
        GenerationMixin.generate,
        GenerationConfig.__dict__["from_dict"],
    )


def _embeds(model) -> torch.Tensor:
    return model.get_input_embeddings()(_ids()).detach()


CASES = [
    ("unknown name", dict(speculation="sequoya"), "Unknown speculation 'sequoya'. Known methods: 'chain'"),
    ("missing draft", dict(speculation="tree", assistant_model=None), "pass `assistant_model=`"),
    ("beam search", dict(speculation="tree", num_beams=2), "beam search"),
    ("several sequences with scores", dict(speculation="chain", num_return_sequences=2, do_sample=True,
                                           return_dict_in_generate=True, output_scores=True),
     "2 sequences. does not support output_scores"),
    ("offloaded cache", dict(speculation="tree", cache_implementation="offloaded_static"), "'dynamic' or 'static'"),
    ("unknown setting", dict(speculation="tree", speculation_config={"width": [2]}), "has no setting"),
    ("bad widths", dict(speculation="tree", speculation_config={"widths": [2, 0]}), "positive integers"),
    ("unknown verifier", dict(speculation="tree", speculation_config={"verifier": "nope"}), "Known verifiers"),
    ("mismatched config", dict(speculation="chain", speculation_config=hf_specdec.TreeConfig()), "make them agree"),
    ("verifier unfit for the drafter", dict(speculation="specexec", do_sample=True,
                                            speculation_config={"verifier": "sequoia", "budget": 8}), "deterministic"),
    ("stateful processor", dict(speculation="tree", guidance_scale=1.5), "UnbatchedClassifierFreeGuidance"),
    ("SynthID watermark", dict(speculation="tree", watermarking_config=SynthIDTextWatermarkingConfig(
        keys=list(range(8)), ngram_len=3)), "SynthIDTextWatermarkLogitsProcessor cannot be used that way"),
    ("config without method", dict(speculation_config={"widths": [2]}), "given without `speculation`"),
    ("missing plan file", dict(speculation="sequoia", speculation_config={"plan": "nope.json"}), "not found"),
    ("inputs_embeds and input_ids", dict(speculation="tree", inputs_embeds=_embeds), "start from `inputs_embeds"),
    ("inputs_embeds alone", dict(speculation="tree", inputs=None, inputs_embeds=_embeds), "pass the prompt as"),
    *[
        (f"{name} verifier, greedy call", dict(speculation="tree", speculation_config={"verifier": name}),
         f"verifier='{name}' samples, but this call decodes greedily")
        for name in ("sequoia", "specinfer", "target_sample")
    ],
    ("chunked prefill", dict(speculation="tree", prefill_chunk_size=2), "cannot honour prefill_chunk_size=2"),
    ("custom position ids", dict(speculation="tree", position_ids=torch.arange(1, 6)[None]), "custom `position_ids`"),
    ("synced GPUs", dict(speculation="tree", synced_gpus=True), "synced_gpus"),
    ("a draft for ngram", dict(speculation="ngram"), "would ignore assistant_model"),
    ("prompt lookup sized as a string", dict(speculation="prompt_lookup", assistant_model=None,
                                             speculation_config={"sized": "False"}), "sized must be True or False"),
    ("stop strings without a tokenizer", dict(speculation="tree", stop_strings=["w9"]), "pass `tokenizer="),
    ("token healing without a tokenizer", dict(speculation="tree", token_healing=True), "token_healing needs"),
    ("a cache with use_cache off", dict(speculation="tree", use_cache=False, **cache_arg(lambda _: DynamicCache())),
     "use_cache=False with a cache passed"),
    ("assisted chain length", dict(speculation="chain", num_assistant_tokens=8),
     "pass speculation_config={'num_draft_tokens': 8} instead"),
    ("assisted confidence on a chain", dict(speculation="chain", assistant_confidence_threshold=0.3),
     "pass speculation_config={'confidence_threshold': 0.3} instead"),
    ("assisted confidence on a tree", dict(speculation="sequoia", assistant_confidence_threshold=0.3),
     "drop it (speculation='chain' takes it as"),
    ("assisted schedule", dict(speculation="tree", num_assistant_tokens_schedule="heuristic"),
     "num_assistant_tokens_schedule='heuristic' sets Transformers' own assisted generation"),
    ("prompt lookup's n-gram", dict(speculation="prompt_lookup", assistant_model=None, max_matching_ngram_size=2),
     "pass speculation_config={'max_ngram': 2} instead"),
    ("a bad confidence threshold", dict(speculation="chain", speculation_config={"confidence_threshold": 1.0}),
     "confidence_threshold must be a probability in"),
]


@pytest.mark.parametrize("kwargs,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_clear_error_and_no_state_left(tiny_pair, kwargs, message):
    target, draft = tiny_pair
    kwargs = {"inputs": _ids(), "assistant_model": draft, "max_new_tokens": 5, **kwargs}
    kwargs = {name: value(target) if isinstance(value, types.FunctionType) else value for name, value in kwargs.items()}
    before = _state(target)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", ".").replace("[", r"\[")):
        target.generate(**kwargs)
    assert _state(target) == before
    # The model still generates normally afterwards.
    assert target.generate(_ids(), max_new_tokens=3, do_sample=False).shape[1] == 8


def test_right_padded_batch(tiny_pair):
    """A batch decodes speculatively (tests/test_batches.py), left-padded as tokenizers pad decoder-only models."""
    target, draft = tiny_pair
    ids = _ids(batch=2)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with pytest.raises(ValueError, match="needs left padding"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, speculation="tree", max_new_tokens=4)


def test_padded_prompt(tiny_pair):
    target, draft = tiny_pair
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match=r"padded inputs: the attention_mask is 0 at position \[0\]"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, speculation="tree", max_new_tokens=4)


def test_a_prompt_holding_the_pad_token_names_it(tiny_pair):
    """No mask passed: Transformers masks every pad token in the prompt, and the refusal says so."""
    target, draft = tiny_pair
    ids = _ids(6)
    ids[0, [1, 4]] = target.generation_config.pad_token_id
    with pytest.raises(ValueError, match=r"the prompt holds pad_token_id=0 at positions \[1, 4\].*attention_mask="
                       r"torch.ones_like\(input_ids\)"):
        target.generate(ids, assistant_model=draft, speculation="tree", max_new_tokens=4)
    # and the fix it names works
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, speculation="tree",
                          max_new_tokens=4, do_sample=False)
    assert torch.equal(out, target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                            do_sample=False))


def test_different_vocabularies(tiny_pair):
    """More than padding apart (see tests/test_vocab_padding.py for what counts as padding)."""
    target, _ = tiny_pair
    other = tiny_model(target.config.model_type, 5, sharpen=1.0, vocab_size=VOCAB + MAX_PADDING_ROWS + 1)
    before = _state(target)
    with pytest.raises(ValueError, match="share one tokenizer"):
        target.generate(_ids(), assistant_model=other, speculation="chain", max_new_tokens=4)
    assert _state(target) == before


def test_encoder_decoder_model():
    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="decoder-only"):
        model.generate(_ids(), assistant_model=model, speculation="chain", max_new_tokens=4)


def test_without_speculation_nothing_changes(tiny_pair):
    target, _ = tiny_pair
    ids = _ids()
    hf_specdec.uninstall()
    try:
        expected = target.generate(ids, max_new_tokens=6, do_sample=False)
    finally:
        hf_specdec.install()
    assert torch.equal(target.generate(ids, max_new_tokens=6, do_sample=False), expected)
    with pytest.raises(ValueError, match="are not used by the model"):
        target.generate(ids, max_new_tokens=2, not_a_kwarg=1)


@pytest.mark.parametrize("role", ["target", "assistant_model"])
def test_flash_attention_refused(tiny_pair, role):
    """Flash-attention reads a 4-D tree mask as padding: refused up front, for either model, before anything runs."""
    target, draft = tiny_pair
    flash = copy.deepcopy(target if role == "target" else draft)
    flash.config._attn_implementation = "flash_attention_2"  # the kernel itself needs a GPU; the check reads the name
    model, assistant = (flash, draft) if role == "target" else (target, flash)
    before = _state(model)
    with pytest.raises(ValueError, match=f"{role} .*flash_attention_2.*sdpa"):
        model.generate(_ids(), assistant_model=assistant, speculation="chain", max_new_tokens=4)
    assert _state(model) == before
