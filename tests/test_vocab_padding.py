"""Drafts whose output layers differ from the target's by padding rows only (Qwen2.5-0.5B has 151,936 rows,
Qwen2.5-7B 152,064, for one tokenizer): accepted, greedy token-identical, and never proposing a row the target
lacks. (Exact sampling with such drafts: tests/test_sampling_generate.py.)"""

from __future__ import annotations

import pytest
import torch

from hf_specdec import ChainConfig, ModelTreeDrafter, SequoiaConfig, SpecExecConfig, StagedConfig, TreeConfig
from hf_specdec.methods.sequoia import plan_tree
from hf_specdec.methods.sequoia.acceptance import teacher_forced_scores
from hf_specdec.methods.sequoia.calibrate import draft_sequences
from hf_specdec.runtime.model_info import MAX_PADDING_ROWS, vocabulary_mismatch
from tests.conftest import TINY_CONFIGS, VOCAB, random_prompt, tiny_model
from tests.helpers.vocabulary import padded


def configs(small):
    return [
        ChainConfig(num_draft_tokens=3),
        TreeConfig(widths=[3, 2]),
        SequoiaConfig(plan=plan_tree([0.6, 0.2, 0.1], budget=8, max_depth=3)),
        SpecExecConfig(budget=16),
        StagedConfig(stages=[small, "ngram"], budget=12),
    ]


@pytest.mark.parametrize("target_rows,draft_rows", [(VOCAB, VOCAB + 8), (VOCAB, VOCAB - 8), (VOCAB + 8, VOCAB)])
def test_greedy_identical_with_padded_vocabularies(tiny_pair, target_rows, draft_rows):
    target, draft = (padded(m, rows) for m, rows in zip(tiny_pair, (target_rows, draft_rows)))
    small = padded(tiny_model(target.config.model_type, 2), draft_rows + 4)  # a lower stage padded differently again
    for seed in range(3):
        ids = random_prompt(torch.Generator().manual_seed(seed), 6)
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        for config in configs(small):
            out = target.generate(ids, assistant_model=draft, speculation=config, max_new_tokens=24, do_sample=False)
            assert torch.equal(out, expected), config.method


@pytest.mark.parametrize("mode", ["top_k", "without_replacement", "with_replacement"])
@pytest.mark.parametrize("draft_rows", [VOCAB + 8, VOCAB - 8])
def test_drafter_speaks_the_targets_vocabulary(mode, draft_rows):
    """Draft distributions come over the target's rows: rows only the draft has are gone, rows it lacks have q = 0."""
    draft = padded(tiny_model("qwen2", 1), draft_rows)
    drafter = ModelTreeDrafter(draft, TreeConfig(widths=[6, 3]).shape(), child_selection=mode,
                               generator=torch.Generator().manual_seed(0), vocab=VOCAB)
    for seed in range(4):
        tree = drafter.propose(random_prompt(torch.Generator().manual_seed(seed), 6))
        assert int(tree.tokens[1:].max()) < min(VOCAB, draft_rows)  # the root is the prompt's last token
        if mode != "top_k":
            assert tree.draft_probs.shape[1] == VOCAB
            assert bool((tree.draft_probs[:, draft_rows:] == 0).all())


def _other_arch(model) -> str:
    return next(arch for arch in TINY_CONFIGS if arch != model.config.model_type)


def test_vocabulary_rule():
    target = tiny_model("qwen2", 0)
    assert vocabulary_mismatch(target, padded(target, VOCAB + MAX_PADDING_ROWS)) is None
    assert vocabulary_mismatch(target, padded(target, VOCAB - 8)) is None
    far = padded(target, VOCAB + MAX_PADDING_ROWS + 1)
    assert "at most 1024 rows apart" in vocabulary_mismatch(target, far)
    other = padded(tiny_model(_other_arch(target), 1), VOCAB + 8)
    assert "model types 'llama' and 'qwen2'" in vocabulary_mismatch(target, other)
    # With the tokenizer known, what matters is that both output layers cover it.
    assert vocabulary_mismatch(target, other, tokenizer_size=VOCAB) is None
    assert vocabulary_mismatch(target, far, tokenizer_size=VOCAB - 4) is None
    assert "fewer than the tokenizer's 64 tokens" in vocabulary_mismatch(target, padded(target, VOCAB - 8), VOCAB)


def test_refusal_names_the_rule_and_a_tokenizer_settles_it(tiny_pair):
    from tests.tiny import tiny_tokenizer

    target, _ = tiny_pair
    other = tiny_model(_other_arch(target), 5, sharpen=1.0, vocab_size=VOCAB + 8)
    ids = random_prompt(torch.Generator().manual_seed(0), 5)
    with pytest.raises(ValueError, match="rows are taken as padding only for models of one model_type.*tokenizer="):
        target.generate(ids, assistant_model=other, speculation="chain", max_new_tokens=4)
    out = target.generate(ids, assistant_model=other, speculation="chain", max_new_tokens=12, do_sample=False,
                          tokenizer=tiny_tokenizer())
    assert torch.equal(out, target.generate(ids, max_new_tokens=12, do_sample=False))


def test_calibration_stays_in_the_targets_vocabulary():
    """Online calibration decodes with the draft alone and runs both models teacher-forced over the result."""
    wide, narrow = padded(tiny_model("qwen2", 1), VOCAB + 8), padded(tiny_model("qwen2", 1), VOCAB - 8)
    prompt = random_prompt(torch.Generator().manual_seed(0), 6)
    ((sequence, start),) = draft_sequences(wide, [prompt], 24, vocab=VOCAB)
    assert int(sequence.max()) < VOCAB and int(draft_sequences(wide, [prompt], 24)[0][0].max()) >= VOCAB
    sequence[-3:] = VOCAB - 1  # a token the narrow draft cannot embed
    assert teacher_forced_scores(narrow, sequence, start, None).shape == (len(sequence) - start, VOCAB - 8)
