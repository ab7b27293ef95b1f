"""Greedy speculation is token-identical to plain `generate`, whatever stops it and whatever watches it."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_specdec import ChainConfig, ModelTreeDrafter, NGramConfig, SpecExecConfig, TreeConfig
from tests.conftest import random_prompt

CONFIGS = [
    ChainConfig(num_draft_tokens=1),
    ChainConfig(num_draft_tokens=4),
    ChainConfig(num_draft_tokens=8, confidence_threshold=0.05),
    TreeConfig(),
    TreeConfig(widths=[3, 3]),
    TreeConfig(parents=[-1, 0, 0, 0, 1, 1, 2, 4, 7]),
    NGramConfig(),
    SpecExecConfig(budget=16, max_depth=4, width=3),
    SpecExecConfig(budget=40, beams=2, width=4),
    NGramConfig(max_ngram=2, depth=3, max_nodes=6),
    NGramConfig(sized=False),
]


def _plain(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


def _spec(target, draft, ids, config, **kwargs):
    assistant = draft if config.needs_assistant else None  # "ngram" refuses a draft it would ignore
    return target.generate(ids, assistant_model=assistant, speculation=config, do_sample=False, **kwargs)


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "-".join([c.method] + [str(v) for v in c.to_dict().values() if v])
)
def test_identical_to_plain_on_random_prompts(tiny_pair, config):
    target, draft = tiny_pair
    generator = torch.Generator().manual_seed(0)
    for trial in range(8):
        ids = random_prompt(generator, 3 + 4 * trial)
        expected = _plain(target, ids, max_new_tokens=40)
        assert torch.equal(_spec(target, draft, ids, config, max_new_tokens=40), expected)


@pytest.mark.parametrize("threshold, most_tokens_per_step", [(0.0, 7), (0.999, 2)])
def test_a_confident_chain_stops_where_the_draft_is_unsure(tiny_pair, threshold, most_tokens_per_step):
    """The target as its own draft: at threshold 0 every step drafts the whole chain (6 tokens, all accepted); a tiny
    random model is never 99.9% sure, so at 0.999 every step drafts one token. Identical to plain either way."""
    target, _ = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(3), 6)
    config = ChainConfig(num_draft_tokens=6, confidence_threshold=threshold)
    out = _spec(target, target, ids, config, max_new_tokens=42, return_dict_in_generate=True)
    plain = _plain(target, ids, max_new_tokens=42, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert max(float(scores.softmax(-1).max()) for scores in plain.scores) < 0.999  # the premise, for 0.999
    stats = out.speculation_stats
    assert stats.draft_forwards <= stats.target_forwards * (most_tokens_per_step - 1)
    assert stats.target_forwards <= 42 / most_tokens_per_step + 1


def test_ngram_drafts_repetitive_text_without_a_draft_model(tiny_pair):
    """Tiny random models fall into loops: prompt lookup must catch them, with no assistant at all."""
    target, _ = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(9), 8)
    expected = _plain(target, ids, max_new_tokens=60)
    out = target.generate(ids, speculation="ngram", do_sample=False, max_new_tokens=60, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.target_forwards < 60 and out.speculation_stats.draft_forwards == 0


def test_draft_equal_to_target_accepts_whole_blocks(tiny_pair):
    """Speculation really happens: a perfect draft makes one target pass per depth + 1 tokens."""
    target, _ = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(1), 7)
    whole_chain = ChainConfig(num_draft_tokens=4, confidence_threshold=0)
    for config, depth in [(whole_chain, 4), (TreeConfig(widths=[2, 2, 1]), 3)]:
        new = 37
        out = _spec(target, target, ids, config, max_new_tokens=new, return_dict_in_generate=True)
        stats = out.speculation_stats
        assert out.sequences.shape[1] == ids.shape[1] + new
        assert stats.target_forwards <= new / (depth + 1) + 1
        assert stats.new_tokens == new and sum(stats.tokens_per_step) == new


def test_eos_inside_an_accepted_block(tiny_pair):
    target, _ = tiny_pair
    generator = torch.Generator().manual_seed(2)
    for _ in range(50):  # a prompt whose continuation has a fresh token strictly inside the second block of 5
        ids = random_prompt(generator, 6)
        free = _plain(target, ids, max_new_tokens=20)[0, ids.shape[1] :].tolist()
        position = next((i for i in range(6, 10) if free[i] not in free[:i]), None)
        if position is not None:
            break
    eos = free[position]
    expected = _plain(target, ids, max_new_tokens=20, eos_token_id=eos)
    assert expected.shape[1] == ids.shape[1] + position + 1
    out = _spec(target, target, ids, ChainConfig(num_draft_tokens=4), max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("new_tokens", [1, 2, 3, 6, 13])
def test_max_new_tokens_reached_inside_a_block(tiny_pair, new_tokens):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(3), 5)
    for assistant in (target, draft):
        out = _spec(target, assistant, ids, ChainConfig(num_draft_tokens=4), max_new_tokens=new_tokens)
        assert torch.equal(out, _plain(target, ids, max_new_tokens=new_tokens))
    out = _spec(target, target, ids, TreeConfig(), max_length=ids.shape[1] + new_tokens)
    assert torch.equal(out, _plain(target, ids, max_length=ids.shape[1] + new_tokens))


class StopAfterToken(StoppingCriteria):
    """Stops once the sequence contains `token` after `start` (a user-written criterion)."""

    def __init__(self, token: int, start: int) -> None:
        self.token, self.start = token, start

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.start :] == self.token).any(dim=1)


def test_custom_stopping_criterion(tiny_pair):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(4), 6)
    free = _plain(target, ids, max_new_tokens=20)[0, ids.shape[1] :].tolist()
    criteria = StoppingCriteriaList([StopAfterToken(free[7], ids.shape[1])])
    expected = _plain(target, ids, max_new_tokens=20, stopping_criteria=criteria)
    assert expected.shape[1] < ids.shape[1] + 20
    for assistant in (target, draft):
        out = _spec(target, assistant, ids, TreeConfig(), max_new_tokens=20, stopping_criteria=criteria)
        assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "processor_kwargs",
    [
        {"repetition_penalty": 1.8},
        {"no_repeat_ngram_size": 2},
        {"repetition_penalty": 1.3, "min_new_tokens": 5, "bad_words_ids": [[7], [9, 10]]},
    ],
)
def test_logits_processors_applied_per_node(tiny_pair, processor_kwargs):
    target, draft = tiny_pair
    generator = torch.Generator().manual_seed(5)
    for trial in range(4):
        ids = random_prompt(generator, 4 + 3 * trial)
        expected = _plain(target, ids, max_new_tokens=30, **processor_kwargs)
        for config in (ChainConfig(num_draft_tokens=3), TreeConfig()):
            assert torch.equal(_spec(target, draft, ids, config, max_new_tokens=30, **processor_kwargs), expected)


class Collector(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended += 1


def test_streamer_receives_exactly_the_plain_tokens(tiny_pair):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(6), 5)
    plain, ours = Collector(), Collector()
    _plain(target, ids, max_new_tokens=25, streamer=plain)
    _spec(target, draft, ids, TreeConfig(), max_new_tokens=25, streamer=ours)
    assert ours.chunks[0] == plain.chunks[0] == ids[0].tolist()  # the prompt first, as generate does
    assert sum(ours.chunks[1:], []) == sum(plain.chunks[1:], [])
    assert ours.ended == plain.ended == 1


def test_return_dict_has_scores_logits_and_stats(tiny_pair):
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(7), 5)
    plain = _plain(target, ids, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = _spec(
        target,
        draft,
        ids,
        TreeConfig(),
        max_new_tokens=12,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == 12 and len(out.logits) == 12
    for ours, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    stats = out.speculation_stats
    assert stats.new_tokens == 12 and stats.target_forwards == len(stats.tokens_per_step)
    assert stats.draft_forwards > 0 and stats.drafted_tokens > 0
    assert sum(stats.tokens_per_step_histogram.values()) == stats.target_forwards


def test_chain_drafter_runs_inside_transformers_assisted_loop(tiny_pair, monkeypatch):
    """The drafter honours `CandidateGenerator`: Transformers' own assisted loop accepts it unchanged."""
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(8), 6)
    expected = _plain(target, ids, max_new_tokens=24)
    drafters = []

    def our_candidate_generator(*args, **kwargs):
        drafters.append(ModelTreeDrafter(draft, ChainConfig(num_draft_tokens=3).shape()))
        return drafters[-1]

    monkeypatch.setattr(target, "_get_candidate_generator", our_candidate_generator)
    out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24)
    assert torch.equal(out, expected)
    assert drafters and drafters[0].forward_count > 0
