"""A chain's confidence threshold learned during the call (`plan/confidence.py`, Transformers' ROC-adapted
`assistant_confidence_threshold`): the least-cost threshold, the samples a step gives, and a chain that uses it."""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec import ChainConfig
from hf_specdec.draft import confident_chain
from hf_specdec.plan.confidence import FALSE_STOP_WEIGHT, LearnedThreshold, least_cost_threshold
from tests.conftest import random_prompt


def _cost(threshold: float, probs: list[float], kept: list[bool]) -> float:
    positives, negatives = sum(kept), len(kept) - sum(kept)
    false_pos = sum(p >= threshold and not k for p, k in zip(probs, kept))
    false_stops = sum(p < threshold and k for p, k in zip(probs, kept))
    return false_pos / negatives + FALSE_STOP_WEIGHT * false_stops / positives


def test_separable_samples_give_the_threshold_between_them():
    probs, kept = [0.9, 0.3, 0.8, 0.2, 0.7, 0.1], [True, False, True, False, True, False]
    assert least_cost_threshold(probs, kept) == 0.7


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.05, 0.2, 0.4, 0.41, 0.6, 0.9, 0.99]), st.booleans()), min_size=2)
       .filter(lambda samples: 0 < sum(k for _, k in samples) < len(samples)))
def test_the_threshold_has_the_least_cost_and_is_the_highest_such(samples):
    probs, kept = [p for p, _ in samples], [k for _, k in samples]
    chosen = least_cost_threshold(probs, kept)
    costs = {t: _cost(t, probs, kept) for t in [math.inf, *probs]}
    best = min(costs.values())
    assert math.isclose(costs[chosen], best)
    assert chosen == max(t for t, cost in costs.items() if math.isclose(cost, best))


def test_a_step_gives_its_kept_tokens_and_the_first_rejected_one():
    learned = LearnedThreshold(0.4)
    learned.observe([0.9, 0.8, 0.3], accepted=1)  # the second token rejected: the third says nothing
    learned.observe([0.95], accepted=3)  # the chain ran on past the tokens whose probability was read
    learned.observe([], accepted=0)  # one token drafted, no probability read
    assert learned.probs == [0.9, 0.8, 0.95] and learned.kept == [True, False, True]
    assert learned.threshold == 0.4  # three samples: too few to learn from


def test_the_threshold_moves_once_both_kinds_are_seen():
    learned = LearnedThreshold(0.4)
    for _ in range(3):
        learned.observe([0.95, 0.9], accepted=2)
    assert learned.threshold == 0.4  # six kept tokens and no rejected one
    learned.observe([0.97, 0.5], accepted=1)
    assert learned.threshold == 0.9  # the rejected token at 0.5 is no longer drafted on; every kept one is


def _noisy_copy(model):
    """`model` with noise on its output layer: a draft the target agrees with some of the time (a tiny random
    draft of another seed is never accepted, so nothing would be learned)."""
    draft = copy.deepcopy(model)
    weight = draft.get_output_embeddings().weight
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * weight.std() * 0.5)
    return draft


def test_a_chain_stops_on_the_learned_threshold_and_stays_lossless(tiny_pair, monkeypatch):
    """Every step drafts on while the token's probability is at least the threshold learned from the steps before
    it, and stops at the first below; greedy output stays plain's."""
    steps = []

    class Watched(LearnedThreshold):
        def observe(self, probs, accepted):
            steps.append((self.threshold, list(probs), accepted))
            super().observe(probs, accepted)

    monkeypatch.setattr(confident_chain, "LearnedThreshold", Watched)
    target, _ = tiny_pair
    draft = _noisy_copy(target)
    ids = random_prompt(torch.Generator().manual_seed(5), 6)
    config = ChainConfig(num_draft_tokens=6, confidence_threshold=0.05, guard=False, adapt_threshold=True)
    out = target.generate(ids, assistant_model=draft, speculation=config, do_sample=False, max_new_tokens=60)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=60))
    assert len({threshold for threshold, _, _ in steps}) > 1  # the premise: it learned something
    for threshold, probs, _ in steps:
        assert all(p >= threshold for p in probs[:-1])
        assert len(probs) == 5 or (probs and probs[-1] < threshold)  # the whole chain, or a stop below it


def test_the_default_keeps_the_threshold(tiny_pair, monkeypatch):
    made = []
    monkeypatch.setattr(confident_chain, "LearnedThreshold", lambda threshold: made.append(threshold))
    target, draft = tiny_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 6)
    config = ChainConfig(num_draft_tokens=6, confidence_threshold=0.05)
    target.generate(ids, assistant_model=draft, speculation=config, do_sample=False, max_new_tokens=20)
    assert made == []
