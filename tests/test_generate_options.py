"""Generate features that must keep working under `speculation=`: the returned cache, stop strings and token healing
(which need the tokenizer Transformers hides from a custom loop), `prefix_allowed_tokens_fn`, watermarking, and
settings stored in the generation config (saved, reloaded, and applied only to calls that can speculate)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    WatermarkingConfig,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_specdec
from hf_specdec import ChainConfig, NGramConfig, SpecExecConfig, TreeConfig
from hf_specdec.core.releases import CACHE, cache_arg, output_cache
from hf_specdec.integration.generation_config import set_speculation
from tests.conftest import VOCAB, random_prompt, tiny_model

CONFIGS = [ChainConfig(num_draft_tokens=3), TreeConfig(widths=[3, 2]), SpecExecConfig(budget=16), NGramConfig()]


def _ids(seed: int, length: int = 6, batch: int = 1) -> torch.LongTensor:
    return torch.cat([random_prompt(torch.Generator().manual_seed(seed + i), length) for i in range(batch)])


def _spec(target, draft, ids, config, **kwargs):
    assistant = draft if config.needs_assistant else None
    return target.generate(ids, assistant_model=assistant, speculation=config, do_sample=False, **kwargs)


# --- the returned cache ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("new_tokens", [1, 2, 3])
def test_returned_cache_holds_what_plain_holds(tiny_pair, new_tokens):
    """A stop inside an accepted block (a perfect draft accepts 5 tokens per step): the cache still ends one token
    before the sequence, and a chat continued from it is the one plain generate continues."""
    target, _ = tiny_pair
    ids = _ids(3, 5)
    plain = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    out = target.generate(ids, assistant_model=target, speculation=ChainConfig(num_draft_tokens=4),
                          max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    length = ids.shape[1] + new_tokens - 1
    assert output_cache(out).get_seq_length() == output_cache(plain).get_seq_length() == length
    for ours, theirs in zip(output_cache(out).layers, output_cache(plain).layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
    follow = torch.cat([plain.sequences, _ids(4, 3)], dim=1)  # the next user turn
    expected = target.generate(follow, **cache_arg(output_cache(plain)), max_new_tokens=12, do_sample=False)
    for speculation in ({}, {"assistant_model": target, "speculation": "chain"}):
        cache = copy.deepcopy(output_cache(out))
        continued = target.generate(follow, **cache_arg(cache), max_new_tokens=12, do_sample=False, **speculation)
        assert torch.equal(continued, expected)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_cache_under_either_name_is_the_one_filled(tiny_pair, name):
    """`cache=` (Transformers 5.24's name) and `past_key_values=` (the older one) both reach the loop on every release:
    the call fills that very cache; the old name warns from 5.24 on, as plain generate does, pointing at the caller."""
    target, draft = tiny_pair
    ids = _ids(5, 6)
    plain = target.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    given = DynamicCache()
    deprecated = name == "past_key_values" and CACHE == "cache"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(ids, assistant_model=draft, speculation="chain", max_new_tokens=10, do_sample=False,
                              return_dict_in_generate=True, **{name: given})
    renamed = [w for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]
    assert len(renamed) == deprecated and all(w.filename == __file__ for w in renamed)
    assert torch.equal(out.sequences, plain.sequences) and output_cache(out) is given
    assert given.get_seq_length() == output_cache(plain).get_seq_length()


def test_a_cache_under_both_names_is_refused(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="Both `cache` and `past_key_values`"):
        target.generate(_ids(5, 6), assistant_model=draft, speculation="chain", max_new_tokens=4,
                        cache=DynamicCache(), past_key_values=DynamicCache())


# --- stop strings and token healing need the tokenizer -----------------------------------------------------------


def test_stop_strings_with_the_tokenizer(tiny_pair, stop_tokenizer):
    target, draft = tiny_pair
    tokenizer = stop_tokenizer
    ids = _ids(5)
    free = target.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :].tolist()
    stop = next(f"w{t}" for i, t in enumerate(free) if i >= 5 and 7 <= t < VOCAB - 1 and t not in free[:i])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] < ids.shape[1] + 20
    for config in CONFIGS:
        assert torch.equal(_spec(target, draft, ids, config, max_new_tokens=20, stop_strings=[stop],
                                 tokenizer=tokenizer), expected)
    stored = copy.deepcopy(target)  # the generation config's stop strings count too
    stored.generation_config.stop_strings = stop
    assert torch.equal(_spec(stored, draft, ids, TreeConfig(), max_new_tokens=20, tokenizer=tokenizer), expected)


def test_token_healing_heals_the_prompt_first(tiny_pair, tokenizer):
    """Prompts ending in "w6" can heal into "w60".."w63": speculation decodes from the prompt plain generate heals."""
    target, draft = tiny_pair
    for seed in range(40):
        words = [f"w{max(7, int(t))}" for t in _ids(seed, 5)[0]] + ["w6"]
        ids = tokenizer(" ".join(words), return_tensors="pt").input_ids
        if not torch.equal(target.heal_tokens(ids, tokenizer), ids):
            break
    else:
        pytest.fail("no prompt whose last token heals")
    expected = target.generate(ids, max_new_tokens=16, do_sample=False, token_healing=True, tokenizer=tokenizer)
    assert not torch.equal(expected[:, : ids.shape[1]], ids)
    for config in CONFIGS[:2]:
        out = _spec(target, draft, ids, config, max_new_tokens=16, token_healing=True, tokenizer=tokenizer,
                    attention_mask=torch.ones_like(ids))
        assert torch.equal(out, expected)


# --- processors that look at more than scores --------------------------------------------------------------------


def test_prefix_allowed_tokens_fn_sees_batch_id_0_and_each_nodes_sentence(tiny_pair):
    target, draft = tiny_pair
    allowed = [list(range(3, VOCAB, 2))]  # one list per batch row, indexed by batch_id as users write it
    batch_ids = set()

    def allowed_tokens(batch_id: int, sentence: torch.Tensor) -> list[int]:
        batch_ids.add(batch_id)
        odd = allowed[batch_id]
        return odd if int(sentence[-1]) % 3 else [t - 1 for t in odd]  # the sentence decides

    for seed in range(3):
        ids = _ids(10 + seed)
        expected = target.generate(ids, max_new_tokens=24, do_sample=False, prefix_allowed_tokens_fn=allowed_tokens)
        for config in CONFIGS:
            out = _spec(target, draft, ids, config, max_new_tokens=24, prefix_allowed_tokens_fn=allowed_tokens)
            assert torch.equal(out, expected)
    assert batch_ids == {0}


def test_green_list_watermark_is_applied_per_node(tiny_pair):
    """Transformers' green-list watermark seeds itself from each row's own tokens: per-node safe, so accepted."""
    target, draft = tiny_pair
    watermark = WatermarkingConfig(bias=6.0, context_width=2)
    ids = _ids(20)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, watermarking_config=watermark)
    assert not torch.equal(expected, target.generate(ids, max_new_tokens=24, do_sample=False))
    for config in CONFIGS:
        assert torch.equal(_spec(target, draft, ids, config, max_new_tokens=24, watermarking_config=watermark),
                           expected)


# --- a stored `speculation` ---------------------------------------------------------------------------------------


def _saved_config(folder) -> dict:
    return json.loads((folder / "generation_config.json").read_text())


def test_speculation_attribute_survives_save_and_reload(tmp_path):
    """`model.generation_config.speculation = ...` on a config derived from the model config, saved and reloaded."""
    target = tiny_model("llama", 0)
    assert target.generation_config._from_model_config
    setting = {"method": "tree", "widths": [3, 2]}
    target.generation_config.speculation = setting
    target.save_pretrained(tmp_path)
    assert _saved_config(tmp_path)["speculation"] == setting and _saved_config(tmp_path)["_from_model_config"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.generation_config.speculation == setting
    assert GenerationConfig.from_pretrained(tmp_path).speculation == setting
    ids = _ids(30)
    out = loaded.generate(ids, assistant_model=loaded, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, tiny_model("llama", 0).generate(ids, max_new_tokens=24, do_sample=False))
    assert out.speculation_stats.method == "tree" and out.speculation_stats.target_forwards <= 8
    loaded.save_pretrained(tmp_path / "again")  # and saved again from the reloaded model
    assert _saved_config(tmp_path / "again")["speculation"] == setting


def test_a_file_marked_from_model_config_keeps_speculation(tmp_path):
    tiny_model("qwen2", 0).save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({**_saved_config(tmp_path), "_from_model_config": True, "speculation": "chain"}))
    assert AutoModelForCausalLM.from_pretrained(tmp_path).generation_config.speculation == "chain"
    hf_specdec.uninstall()  # Transformers' own loader drops the field: uninstall undoes the patch
    try:
        assert getattr(GenerationConfig.from_pretrained(tmp_path), "speculation", None) is None
    finally:
        hf_specdec.install()
    assert GenerationConfig.from_pretrained(tmp_path).speculation == "chain"


@pytest.fixture(scope="module")
def stored_ngram():
    """(model storing speculation="ngram", the same model storing nothing)."""
    model, plain = tiny_model("llama", 0), tiny_model("llama", 0)
    set_speculation(model.generation_config, "ngram")
    return model, plain


@pytest.mark.parametrize(
    "call",
    [
        dict(num_beams=2),
        dict(speculation=None),
        dict(assistant_model="draft"),  # Transformers' own assisted generation, which ngram cannot use
    ],
    ids=["beams", "explicit-none", "with-a-draft"],
)
def test_stored_setting_leaves_calls_it_cannot_run_plain(stored_ngram, call):
    model, plain = stored_ngram
    call = dict(call)
    ids = _ids(40, 8, batch=call.pop("batch", 1))
    if call.get("assistant_model") == "draft":
        call["assistant_model"] = tiny_model("llama", 1)
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, **call)
    torch.manual_seed(0)
    out = model.generate(ids, **kwargs)
    torch.manual_seed(0)
    expected = plain.generate(ids, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert type(out) is type(expected) and type(out) is not hf_specdec.SpeculativeDecoderOnlyOutput


def test_stored_setting_applies_to_a_batch(stored_ngram):
    model, plain = stored_ngram
    ids = _ids(40, 8, batch=2)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert [row.method for row in out.speculation_stats] == ["prompt_lookup"] * 2
    assert torch.equal(out.sequences, plain.generate(ids, max_new_tokens=12, do_sample=False))


def test_stored_setting_applies_to_calls_that_can_speculate(stored_ngram):
    model, plain = stored_ngram
    ids = _ids(50, 8)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert out.speculation_stats.method == "prompt_lookup"  # stored as "ngram", its alias
    assert torch.equal(out.sequences, plain.generate(ids, max_new_tokens=24, do_sample=False))
    assert isinstance(out, GenerateDecoderOnlyOutput)
