"""Every input `generate` accepts reaches every pass or is refused, and every output plain `generate` returns is
returned with plain's values (the cases Transformers' own assisted-decoding tests found)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2DoubleHeadsModel,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from hf_specdec import plan_tree
from hf_specdec.core.model_inputs import decoding_inputs, explicit_parameters
from tests.families import FAMILIES, family
from tests.helpers.outputs import assert_outputs_equal
from tests.tiny import build, tiny_model

METHODS = {
    "chain": {"num_draft_tokens": 3},
    "tree": {},
    "sequoia": {"plan": plan_tree([0.7, 0.15, 0.05], 16, 6)},
    "specexec": {"budget": 16, "max_depth": 6},
    "staged": {"budget": 16},
    "ngram": {},
}
NEW = 24


def speculate(model, method: str, **kwargs):
    draft = {} if method == "ngram" else {"assistant_model": copy.deepcopy(model)}
    return model.generate(speculation=method, speculation_config=METHODS[method], **draft, **kwargs)


@functools.cache
def gpt2(cls=GPT2LMHeadModel):
    return build(GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2), model_class=cls)


def prompt(vocab: int = 96, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("method", METHODS)
def test_token_type_ids_reach_every_pass(method):
    model, ids = gpt2(), prompt()
    types = torch.randint(0, 16, ids.shape, generator=torch.Generator().manual_seed(1))
    expected = model.generate(ids, token_type_ids=types, do_sample=False, max_new_tokens=NEW)
    assert not torch.equal(expected, model.generate(ids, do_sample=False, max_new_tokens=NEW))  # they matter
    out = speculate(model, method, input_ids=ids, token_type_ids=types, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("method", METHODS)
def test_forward_without_logits_to_keep(method):
    model, ids = gpt2(GPT2DoubleHeadsModel), prompt()
    assert "logits_to_keep" not in explicit_parameters(model)  # swallowed by **kwargs: full-length logits
    expected = model.generate(ids, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(speculate(model, method, input_ids=ids, do_sample=False, max_new_tokens=NEW), expected)


@functools.cache
def vision_language_model():
    return family("Gemma 3 (vision-language)").build()  # its image is one token, id 5


@pytest.mark.parametrize("method", METHODS)
def test_vision_language_model_sees_the_image(method):
    model = vision_language_model()
    ids = torch.tensor([[1, 3, 5, 4, 9]])  # bos, begin image, the image, end image, a text token
    image = dict(pixel_values=torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 3,
                 token_type_ids=(ids == 5).long())
    expected = model.generate(ids, **image, do_sample=False, max_new_tokens=NEW)
    without = model.generate(ids, token_type_ids=image["token_type_ids"], do_sample=False, max_new_tokens=NEW)
    assert not torch.equal(expected, without)  # the image changes the output
    out = speculate(model, method, input_ids=ids, **image, do_sample=False, max_new_tokens=NEW)
    assert torch.equal(out, expected)


class WithExtraInput(LlamaForCausalLM):
    """A model that takes an input of its own at every pass: speculation cannot place it on tree nodes."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, bias_scale=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        if bias_scale is not None:
            out.logits = out.logits + bias_scale
        return out


@functools.cache
def llama(attn: str = "eager", cls=LlamaForCausalLM):
    return tiny_model("llama", 0, attn=attn, model_class=cls, vocab_size=96, max_position_embeddings=256)


@pytest.mark.parametrize(
    "model, kwargs, phrase",
    [
        (lambda: llama(cls=WithExtraInput), dict(bias_scale=torch.ones(96)), "takes bias_scale at every decoding"),
        (llama, dict(position_ids=torch.arange(3, 12)[None]), "custom `position_ids`"),
        (llama, dict(prefill_chunk_size=4), "prefill_chunk_size=4"),
    ],
    ids=["unplaceable input", "position ids", "chunked prefill"],
)
def test_refused_before_anything_runs(model, kwargs, phrase):
    model = model()
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=phrase):
            model.generate(prompt(), speculation="chain", assistant_model=copy.deepcopy(model), do_sample=False,
                           max_new_tokens=4, **kwargs)
    finally:
        handle.remove()
    assert not calls


# --------------------------------------------------------------------------- outputs


ALL_OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True,
                   output_attentions=True, do_sample=False, max_new_tokens=NEW)


@pytest.mark.parametrize("method", METHODS)
def test_every_output_equals_plain(method):
    model, ids = llama(), prompt()
    expected = model.generate(ids, **ALL_OUTPUTS)
    out = speculate(model, method, input_ids=ids, **ALL_OUTPUTS)
    assert out.speculation_stats.target_forwards < NEW  # it did speculate: several tokens per pass
    assert_outputs_equal(out, expected)
    assert out.hidden_states[0][0].shape[1] == ids.shape[1] and out.hidden_states[1][0].shape[1] == 1


def test_attentions_without_eager_as_plain():
    """SDPA computes no attention weights: plain `generate` warns (saying to load eager attention) and returns empty
    tuples; so does speculation."""
    model, ids = llama("sdpa"), prompt()
    expected = model.generate(ids, **ALL_OUTPUTS)
    out = speculate(model, "tree", input_ids=ids, **ALL_OUTPUTS)
    assert all(step == () for step in expected.attentions)
    assert_outputs_equal(out, expected)


SUPPORTED = [f for f in FAMILIES if f.supported]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("entry", SUPPORTED, ids=[f.name for f in SUPPORTED])
def test_family_sweep_inputs_and_outputs(entry, method):
    """Transformers' assisted-decoding test, with `speculation=`: every input the family's forward names that a
    tester passes (an all-ones mask, token types) and every output, equal to plain `generate` (eager attention)."""
    model = family(entry.name).build()
    model.set_attn_implementation("eager")
    ids = prompt(length=10)
    inputs = {"attention_mask": torch.ones_like(ids)}
    if "token_type_ids" in explicit_parameters(model):
        inputs["token_type_ids"] = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(2))
    placed = "token_type_ids" in decoding_inputs(model, ids, inputs)  # at every pass, so at every tree node
    assert ("types" in entry.traits) == placed  # README's matrix says so
    settings = dict(ALL_OUTPUTS, max_new_tokens=12)
    expected = model.generate(ids, **inputs, **settings)
    out = speculate(model, method, input_ids=ids, **inputs, **settings)
    assert_outputs_equal(out, expected)
