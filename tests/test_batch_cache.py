"""The cache a speculative batch returns (issue 25): plain batched `generate`'s layout, every row in it.

Plain's cache holds, in column j of row r, the key/value of the token at `sequences[r, j]`, for every column but the
last; a row that ended early (eos) holds its end token's key/value too (plain fed it), then the pad tokens' plain fed
it after. The batch returns the same cache class with the same key/value in every column (float32 tolerances: tree
passes compute them in other matrix shapes), and generate continues from it as from plain's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.core.releases import cache_arg, output_cache
from tests.families import FAMILIES
from tests.helpers.batches import NEW, eos_firing_in_one_row, kwargs_for, near_draft, padded_batch
from tests.tiny import TINY_CONFIGS, tiny_model

FAMILY = {family.name: family for family in FAMILIES}
#: tiny_model's architectures and a few more families of tests/families.py that a batch speculates on
ARCHS = [*sorted(TINY_CONFIGS), "Qwen3", "Phi", "GPT-2"]
METHODS = ["chain", "tree", "sequoia", "specexec"]


@pytest.fixture(scope="module", params=ARCHS)
def family_pair(request):
    name = request.param
    target = tiny_model(name, 0) if name in TINY_CONFIGS else FAMILY[name].build(0)
    return target, near_draft(target)


def ends(sequences: torch.LongTensor, prompt: int, eos: int | None) -> list[int]:
    """Each row's length up to its last token (its eos where it ended early: plain pads after it)."""
    lengths = []
    for row in sequences[:, prompt:].tolist():
        stop = row.index(eos) + 1 if eos is not None and eos in row else len(row)
        lengths.append(prompt + stop)
    return lengths


def calls(target, method: str, draft, stop: str):
    ids, mask = padded_batch(3, [0, 3, 5])
    eos = eos_firing_in_one_row(target, ids, mask) if stop == "eos" else None
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                return_dict_in_generate=True)
    plain = target.generate(ids, **call)
    spec = target.generate(ids, **call, **kwargs_for(method, draft))
    assert torch.equal(spec.sequences, plain.sequences)
    return ids, mask, eos, plain, spec


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stop", ["max_new_tokens", "eos"])
def test_batch_returns_plain_batched_cache_row_by_row(family_pair, method, stop):
    target, draft = family_pair
    ids, mask, eos, plain, spec = calls(target, method, draft, stop)
    cache, expected = output_cache(spec), output_cache(plain)
    assert type(cache) is type(expected) is DynamicCache
    assert [type(layer) for layer in cache.layers] == [type(layer) for layer in expected.layers]
    width = plain.sequences.shape[1] - 1
    assert cache.get_seq_length() == expected.get_seq_length() == width
    lengths = ends(plain.sequences, ids.shape[1], eos)
    if stop == "eos":
        assert min(lengths) < max(lengths)  # a row ended early: its eos's key/value is plain's too
    for ours, theirs in zip(cache.layers, expected.layers):  # every row, every column: pads included
        torch.testing.assert_close(ours.keys, theirs.keys)
        torch.testing.assert_close(ours.values, theirs.values)
        prompt = ids.shape[1] - 1  # the prefill's columns: the same pass as plain's
        assert torch.equal(ours.keys[:, :, :prompt], theirs.keys[:, :, :prompt])


@pytest.mark.parametrize("method", ["chain", "specexec"])
@pytest.mark.parametrize(("stop", "masked"), [("max_new_tokens", "left pads"), ("eos", "left pads"),
                                              ("eos", "all pads")])
def test_generate_continues_from_the_returned_cache_as_from_plains(family_pair, method, stop, masked):
    """Calling generate again on the returned sequences with the returned cache gives the tokens (and, to float32
    tolerances, the logits) that continuing from plain's own sequences and cache gives: with the call's mask grown
    by ones (as plain's own loop grows it: the pads after a row's end attended to), or with those pads masked too.
    The cache is used, not rebuilt: the continuation grows it by its new tokens."""
    target, draft = family_pair
    ids, mask, eos, plain, spec = calls(target, method, draft, stop)
    sequences = plain.sequences
    attention = torch.cat([mask, torch.ones_like(sequences[:, ids.shape[1]:])], dim=1)
    if masked == "all pads":
        for row, length in enumerate(ends(sequences, ids.shape[1], eos)):
            attention[row, length:] = 0
    more = 8
    continued = [target.generate(sequences, attention_mask=attention, **cache_arg(output_cache(out)),
                                 max_new_tokens=more, do_sample=False, return_dict_in_generate=True,
                                 output_logits=True) for out in (plain, spec)]
    assert torch.equal(continued[1].sequences, continued[0].sequences)
    torch.testing.assert_close(torch.stack(continued[1].logits), torch.stack(continued[0].logits))
    assert output_cache(spec).get_seq_length() == sequences.shape[1] + more - 1
