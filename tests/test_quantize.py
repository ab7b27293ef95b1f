"""An int8 draft (PyTorch dynamic quantization) proposes; the target still decides: output unchanged."""

from __future__ import annotations

import pytest
import torch

from hf_specdec import quantize_draft
from hf_specdec.drafting.quantize import is_quantized
from tests.conftest import random_prompt, tiny_model


@pytest.mark.parametrize("method", ["chain", "tree", "specexec", "sequoia"])
def test_quantized_draft_is_lossless_and_still_accepted(method):
    target = tiny_model("qwen2", 0)
    draft = quantize_draft(target)
    assert is_quantized(draft) and not is_quantized(target)
    assert type(draft.model.layers[0].mlp.up_proj).__module__.startswith("torch.ao.nn.quantized")
    assert target.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # the original is untouched
    settings = {"budget": 16} if method == "specexec" else None
    for seed in range(3):
        ids = random_prompt(torch.Generator().manual_seed(seed), 6)
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config=settings,
                              max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        if method != "sequoia":  # sequoia may rightly size a tree-less plan for a draft as slow as the target
            assert out.speculation_stats.mean_tokens_per_step > 2  # int8 noise rarely changes the draft's choice
