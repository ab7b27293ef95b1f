"""A draft whose output layer covers a subset of the vocabulary (FR-Spec): cheaper passes, outputs unchanged.

Exact sampling with such a draft is enumerated in tests/test_sampling_exact.py (the `draft_vocabulary_subset` case).
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_specdec
from hf_specdec import frequent_tokens, quantize_draft, restrict_vocabulary
from hf_specdec.kernels.vocabulary import SubsetHead
from hf_specdec.methods.sequoia.store import plan_filename
from hf_specdec.runtime.model_info import quantization, vocab_size
from tests.conftest import VOCAB, tiny_model
from tests.tiny import tiny_tokenizer

KEEP = torch.arange(0, VOCAB, 2)  # every other token: the draft can never propose an odd one
METHODS = {"chain": {}, "tree": {}, "sequoia": {"plan": hf_specdec.plan_tree([0.6, 0.2], 12, 5)},
           "specexec": {"budget": 12}, "staged": {"budget": 12}}


def test_subset_head_keeps_its_rows_and_hides_the_rest():
    head = torch.nn.Linear(8, 10, bias=True)
    sub = SubsetHead(head, torch.tensor([7, 2, 2, 5]))
    hidden = torch.randn(3, 8)
    logits = sub(hidden)
    assert logits.shape == (3, 10) and sub.out_features == 10
    kept = torch.tensor([2, 5, 7])
    torch.testing.assert_close(logits[:, kept], head(hidden)[:, kept])
    others = torch.ones(10, dtype=torch.bool).index_fill_(0, kept, False)
    assert bool(torch.isneginf(logits[:, others]).all())


@pytest.mark.parametrize("method", METHODS)
def test_restricted_draft_is_lossless_and_never_proposes_other_tokens(method):
    target = tiny_model("llama", 0)
    draft = restrict_vocabulary(copy.deepcopy(target), KEEP)
    assert vocab_size(draft) == VOCAB and quantization(draft) == f"float, vocabulary {len(KEEP)}"
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = target.generate(ids, do_sample=False, max_new_tokens=24)
    assert bool((expected[0, 8:] % 2 == 1).any())  # the target does emit tokens the draft cannot propose
    out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config=METHODS[method],
                          do_sample=False, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.target_forwards < 24  # it still speculates (even tokens are accepted)


def test_transformers_assisted_generation_takes_the_restricted_draft():
    """The head returns full-width logits, so Transformers' own assisted generation can use the same draft."""
    target = tiny_model("qwen2", 1)
    draft = restrict_vocabulary(copy.deepcopy(target), KEEP)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    expected = target.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=16), expected)


@pytest.mark.parametrize("scheme", ["dynamic-int8", "int4", "mixed"])
def test_quantized_restricted_draft(scheme):
    target = tiny_model("llama", 0)
    keep = KEEP[:-1]  # a count that is not a multiple of the int4 kernel's row block (16)
    draft = quantize_draft(target, vocabulary=keep, scheme=scheme)
    assert quantization(draft) == f"{scheme}, vocabulary {len(keep)}" and len(keep) % 16
    assert quantization(target) is None and isinstance(target.get_output_embeddings(), torch.nn.Linear)  # untouched
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    out = target.generate(ids, assistant_model=draft, speculation="specexec", do_sample=False, max_new_tokens=16)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=16))
    with pytest.raises(TypeError, match="restrict the vocabulary before quantizing"):
        restrict_vocabulary(draft, keep)
    names = {plan_filename(target, d, 0.0) for d in (target, quantize_draft(target, scheme=scheme), draft)}
    assert len(names) == 3  # each draft's latency curves and plans are saved apart, never over each other


def test_bad_token_ids_are_refused():
    for ids in ([], [VOCAB], [-1]):
        with pytest.raises(ValueError, match="non-empty ids below the output layer's"):
            restrict_vocabulary(tiny_model("llama", 0), ids)


def test_frequent_tokens_counts_text_and_keeps_special_tokens():
    tokenizer = tiny_tokenizer()
    texts = ["w7 w7 w7 w8 w8 w9", "w7 w8"]
    top = frequent_tokens(tokenizer, texts, size=2)
    w7, w8 = (tokenizer.convert_tokens_to_ids(w) for w in ("w7", "w8"))
    assert {w7, w8} <= set(top.tolist()) and tokenizer.convert_tokens_to_ids("w9") not in top.tolist()
    assert set(tokenizer.all_special_ids) <= set(top.tolist())
    assert top.tolist() == sorted(top.tolist())
