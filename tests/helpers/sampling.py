"""Sampling through `generate`: the pair, prompt and processors, and the joint distribution of the first tokens."""

from __future__ import annotations

import copy

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from tests.tiny import tiny_model

VOCAB = 8


SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.3}


PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5, 3]])  # repeats, so prompt lookup (n-gram) drafts something too


SAMPLES = 600


def _processors() -> LogitsProcessorList:
    return LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(SAMPLING["repetition_penalty"]),
        TemperatureLogitsWarper(SAMPLING["temperature"]),
        TopPLogitsWarper(SAMPLING["top_p"]),
    ])


def sampling_pair():
    """(target, draft) over `VOCAB` tokens, the draft a noisy copy of the target."""
    target = tiny_model("llama", 0, sharpen=6.0, vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    draft = copy.deepcopy(target)  # close to the target, not equal: accepts often, rejects sometimes
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * 1.5)
    return target, draft


def _dist(target, ids: torch.Tensor, processors: LogitsProcessorList | None = None) -> torch.Tensor:
    with torch.no_grad():
        logits = target(ids).logits[:, -1].float()
    return (processors or _processors())(ids, logits).softmax(-1)[0].double()


def joint_of(target, prompt: torch.Tensor,
             processors: LogitsProcessorList | None = None) -> dict[tuple[int, int], float]:
    """P(first two sampled tokens after `prompt`) under plain sampling with `processors` (default `SAMPLING`'s),
    computed prefix by prefix."""
    first = _dist(target, prompt, processors)
    joint = {}
    for a in range(VOCAB):
        if first[a] > 0:
            second = _dist(target, torch.cat([prompt, torch.tensor([[a]])], dim=1), processors)
            joint.update({(a, b): float(first[a] * second[b]) for b in range(VOCAB) if second[b] > 0})
    return joint
