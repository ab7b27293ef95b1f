"""End to end: `generate(do_sample=True, speculation=...)` samples exactly the plain-sampling distribution.

A tiny model over an 8-token vocabulary makes the exact distribution of two sampled tokens computable: run the
target on every prefix and apply the same processors plain `generate` applies (repetition penalty, temperature,
top-p; checked against generate's own `output_scores`). Speculative samples are then compared with it by a
chi-square goodness-of-fit test, for every registered method and every sampling verifier.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import hf_specdec
from hf_specdec.methods.sequoia import plan_tree
from tests.helpers.exactness import chi_square_pvalue, total_variation
from tests.helpers.sampling import PROMPT, SAMPLES, SAMPLING, VOCAB, _dist, _processors, joint_of, sampling_pair


@pytest.fixture(scope="module")
def models():
    return sampling_pair()


@pytest.fixture(scope="module")
def exact(models):
    return joint_of(models[0], PROMPT)


def test_processors_match_what_generate_applies(models):
    target, _ = models
    torch.manual_seed(1)
    out = target.generate(PROMPT, max_new_tokens=2, output_scores=True, return_dict_in_generate=True, **SAMPLING)
    for step, scores in enumerate(out.scores):
        prefix = out.sequences[:, : PROMPT.shape[1] + step]
        with torch.no_grad():
            logits = target(prefix).logits[:, -1].float()
        torch.testing.assert_close(scores.float(), _processors()(prefix, logits), atol=1e-5, rtol=1e-5)


def _config(method: str, verifier: str | None):
    if verifier == "confident":  # a chain that stops after a token the draft is unsure of (its default verifier)
        return {"num_draft_tokens": 3, "confidence_threshold": 0.5}
    settings = {"verifier": verifier} if verifier else {}
    if method == "sequoia":  # an explicit plan: no calibration inside a frequency test
        settings["plan"] = plan_tree([0.6, 0.2, 0.1], budget=8, max_depth=3)
    if method == "chain":  # Transformers' stop: sized by the clock, the chain would rightly turn steps plain
        settings["confidence_threshold"] = 0.4
    if method in ("specexec", "staged"):  # a fixed budget: sized by the clock, a draft as costly as this target's
        settings["budget"] = 8  # would rightly stop drafting on a busy machine, and the test needs speculation
    if method in ("prompt_lookup", "ngram"):  # whole trees: the sizing, which learns how rarely a tiny model's
        settings["sized"] = False  # lookups are kept, would rightly turn most steps plain; the test needs speculation
    return settings


CASES = [(m, None) for m in sorted(hf_specdec.SPECULATION_METHODS)] + [
    ("tree", "specinfer"),
    ("tree", "target_sample"),
    ("sequoia", "sequoia"),
    ("chain", "confident"),
]


@pytest.mark.parametrize("method,verifier", CASES, ids=[f"{m}-{v or 'default'}" for m, v in CASES])
def test_sampling_frequencies_match_plain_sampling(models, exact, method, verifier):
    target, draft = models
    config = hf_specdec.SPECULATION_METHODS[method]
    assistant = draft if config.needs_assistant else None
    torch.manual_seed(1234)
    counts, accepted_drafts = Counter(), 0
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, assistant_model=assistant, speculation=method,
                              speculation_config=_config(method, verifier), max_new_tokens=2,
                              return_dict_in_generate=True, **SAMPLING)
        counts[tuple(out.sequences[0, PROMPT.shape[1] :].tolist())] += 1
        accepted_drafts += out.speculation_stats.target_forwards == 1  # both tokens from one target pass
    assert sum(counts.values()) == SAMPLES
    assert chi_square_pvalue(counts, exact, SAMPLES) > 1e-3
    # ~50 cells at 600 samples: sampling noise alone gives a total variation near 0.12; a biased sampler far more.
    assert total_variation({k: c / SAMPLES for k, c in counts.items()}, exact) < 0.2
    assert accepted_drafts > SAMPLES // 10  # speculation happened: drafted tokens were accepted
    if verifier == "confident":  # both kinds of step were sampled: the draft is sure of one first token, not others
        first = _dist(draft, PROMPT)
        assert float(first[first >= 0.5].sum()) > 0.2 and float(first[first < 0.5].sum()) > 0.2


PADDED = [("tree", "sequoia", VOCAB + 3), ("tree", "specinfer", VOCAB - 2), ("specexec", None, VOCAB + 3)]


@pytest.mark.parametrize("method,verifier,rows", PADDED, ids=[f"{m}-{v or 'default'}-{r}rows" for m, v, r in PADDED])
def test_sampling_exact_with_a_draft_padded_differently(models, exact, method, verifier, rows):
    """Draft rows the target lacks (made the draft's favourites) are never proposed; target rows the draft lacks
    have q = 0: sampling stays exact (the chi-square test above), and drafts are still accepted."""
    from tests.helpers.vocabulary import padded

    target, draft = models
    draft = padded(draft, rows)
    settings = {"budget": 8} if method == "specexec" else _config(method, verifier)  # no calibration here
    torch.manual_seed(99)
    counts, accepted_drafts = Counter(), 0
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, assistant_model=draft, speculation=method, speculation_config=settings,
                              max_new_tokens=2, return_dict_in_generate=True, **SAMPLING)
        counts[tuple(out.sequences[0, PROMPT.shape[1] :].tolist())] += 1
        accepted_drafts += out.speculation_stats.target_forwards == 1
    assert chi_square_pvalue(counts, exact, SAMPLES) > 1e-3
    assert total_variation({k: c / SAMPLES for k, c in counts.items()}, exact) < 0.2
    assert accepted_drafts > SAMPLES // 10


#: a batch of four rows: the prompt (no padding), and the prompt without its first two tokens, left-padded by two.
#: Rows accept different numbers of tokens in the first step, so a row that goes on to its second token sees holes
#: in the cache (another row kept more columns)
BATCH_PADS = [0, 2, 0, 2]


def _padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = PROMPT.repeat(len(BATCH_PADS), 1)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(BATCH_PADS):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


@pytest.fixture(scope="module")
def exact_padded(models):
    """The padded rows' P(first two tokens): their prompt's alone (plain batched generate's repetition penalty skips
    each row's padding, and the model sees no pad)."""
    return joint_of(models[0], PROMPT[:, max(BATCH_PADS) :])


def test_padded_row_distribution_is_its_prompts_alone(models):
    """What `exact_padded` relies on: plain batched sampling scores a padded row as its prompt alone."""
    target, _ = models
    ids, mask = _padded_prompts()
    out = target.generate(ids, attention_mask=mask, max_new_tokens=1, output_scores=True,
                          return_dict_in_generate=True, **SAMPLING)
    for row, pad in enumerate(BATCH_PADS):
        torch.testing.assert_close(out.scores[0][row].softmax(-1).double(), _dist(target, PROMPT[:, pad:]),
                                   atol=1e-5, rtol=1e-5)


BATCH_CASES = [("chain", None), ("tree", None), ("tree", "specinfer"), ("sequoia", "sequoia"), ("specexec", None)]


@pytest.mark.parametrize("method,verifier", BATCH_CASES, ids=[f"{m}-{v or 'default'}" for m, v in BATCH_CASES])
def test_batch_rows_sample_exactly_as_plain_batched_sampling(models, exact, exact_padded, method, verifier):
    """Every row of a sampled batch draws its first two tokens from plain batched sampling's distribution for that
    row (chi-square over SAMPLES draws per kind of row, unpadded and padded): each row is verified on its own
    scores and its own draft distribution, and a row's second step runs over a cache with holes."""
    target, draft = models
    config = hf_specdec.SPECULATION_METHODS[method]
    ids, mask = _padded_prompts()
    torch.manual_seed(4321)
    counts, accepted_drafts = {False: Counter(), True: Counter()}, 0
    for _ in range(SAMPLES // 2):  # two rows of each kind per call
        out = target.generate(ids, attention_mask=mask, assistant_model=draft if config.needs_assistant else None,
                              speculation=method, speculation_config=_config(method, verifier), max_new_tokens=2,
                              return_dict_in_generate=True, **SAMPLING)
        assert isinstance(out.speculation_stats, list)  # the batch loop decoded it
        for row, pad in enumerate(BATCH_PADS):
            counts[pad > 0][tuple(out.sequences[row, ids.shape[1] :].tolist())] += 1
        accepted_drafts += sum(row.target_forwards == 1 for row in out.speculation_stats)
    for padded_rows, want in ((False, exact), (True, exact_padded)):
        assert chi_square_pvalue(counts[padded_rows], want, SAMPLES) > 1e-3, (padded_rows, counts[padded_rows])
        assert total_variation({k: c / SAMPLES for k, c in counts[padded_rows].items()}, want) < 0.2
    assert accepted_drafts > SAMPLES // 10  # speculation happened: drafted tokens were accepted
    if verifier == "confident":  # both kinds of step were sampled: the draft is sure of one first token, not others
        first = _dist(draft, PROMPT)
        assert float(first[first >= 0.5].sum()) > 0.2 and float(first[first < 0.5].sum()) > 0.2
