"""Generate features that must keep working under `speculation=`: the returned cache, stop strings and token healing
(which need the tokenizer Transformers hides from a custom loop), `prefix_allowed_tokens_fn`, watermarking, and
settings stored in the generation config (saved, reloaded, and applied only to calls that can speculate)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import WatermarkingConfig

from hf_specdec import ChainConfig, NGramConfig, SpecExecConfig, TreeConfig
from tests.conftest import VOCAB, random_prompt

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
    assert out.past_key_values.get_seq_length() == plain.past_key_values.get_seq_length() == length
    for ours, theirs in zip(out.past_key_values.layers, plain.past_key_values.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
    follow = torch.cat([plain.sequences, _ids(4, 3)], dim=1)  # the next user turn
    expected = target.generate(follow, past_key_values=plain.past_key_values, max_new_tokens=12, do_sample=False)
    for speculation in ({}, {"assistant_model": target, "speculation": "chain"}):
        cache = copy.deepcopy(out.past_key_values)
        continued = target.generate(follow, past_key_values=cache, max_new_tokens=12, do_sample=False, **speculation)
        assert torch.equal(continued, expected)


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


