"""The embedded real pair (Qwen2.5-Coder 1.5B target, 0.5B draft) in float32: greedy speculation is lossless."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.prompts import humaneval_prompts

pytestmark = pytest.mark.real

PROMPTS = humaneval_prompts(4)
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def plain_outputs(real_pair_fp32):
    target, _, tokenizer = real_pair_fp32
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        outputs.append((ids, target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)))
    return outputs


@pytest.mark.parametrize("speculation", ["chain", "tree"])
def test_greedy_identical_to_plain_on_humaneval(real_pair_fp32, plain_outputs, speculation):
    target, draft, _ = real_pair_fp32
    steps = 0
    for ids, expected in plain_outputs:
        out = target.generate(
            ids,
            assistant_model=draft,
            speculation=speculation,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, expected)
        steps += out.speculation_stats.target_forwards
    # The real draft agrees often enough that speculation pays in target passes.
    assert steps < len(PROMPTS) * NEW_TOKENS / 2
