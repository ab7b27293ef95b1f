"""hf_specdec.prepack: Linear weights prepacked in oneDNN's layout: same outputs, undoable, skipped where it can't."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import hf_specdec
from hf_specdec.core.releases import HUB_KERNELS_BY_DEFAULT
from hf_specdec.kernels import PackedLinear, is_prepacked
from hf_specdec.kernels.prepack import can_prepack, packable_dtypes
from hf_specdec.plan.latency import placement
from hf_specdec.runtime.devices import kernels
from tests.conftest import random_prompt, tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_model_decodes_like_itself_and_speculation_stays_lossless(dtype):
    target, draft = tiny_model("qwen2", 0).to(dtype), tiny_model("qwen2", 1).to(dtype)
    ids = random_prompt(torch.Generator().manual_seed(3), 10)
    before = target.generate(ids, max_new_tokens=24, do_sample=False)
    weights = {name: p.detach().clone() for name, p in target.state_dict().items()}
    report = hf_specdec.prepack(target, measure=False)
    if dtype not in packable_dtypes():  # oneDNN packs bfloat16 only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        assert not report.packed and "cannot pack bfloat16" in report.reason and not is_prepacked(target)
        assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False), before)
        return
    assert report.packed and is_prepacked(target) and isinstance(target.lm_head, PackedLinear)
    assert kernels(target) == "onednn-prepacked" and placement(target)["kernels"] == "onednn-prepacked"
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    if dtype == torch.bfloat16:  # the same oneDNN kernel, packed once instead of per call: bit for bit
        assert torch.equal(plain, before)
    for method in ("tree", "specexec", "chain"):
        out = target.generate(ids, assistant_model=draft, speculation=method, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, plain), method
    saved = target.state_dict()  # what save_pretrained writes: the plain weights, under their usual names
    assert saved.keys() == weights.keys() and all(torch.equal(saved[k], v) for k, v in weights.items())
    assert hf_specdec.unpack(target) > 0 and not is_prepacked(target) and kernels(target) == "default"
    assert all(torch.equal(target.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False), before)


def test_models_loaded_with_hub_kernels_stay_lossless(tmp_path, monkeypatch):
    """From Transformers 5.25 on, `from_pretrained` kernelizes by default (`use_kernels`): a target so loaded,
    prepacked and run through the lean tree pass, and its int8 draft, decode as plain generate does."""
    from transformers import AutoModelForCausalLM

    for seed, name in ((0, "target"), (1, "draft")):
        tiny_model("qwen2", seed).save_pretrained(tmp_path / name)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float32)
    assert bool(getattr(target, "use_kernels", False)) == HUB_KERNELS_BY_DEFAULT
    ids = random_prompt(torch.Generator().manual_seed(5), 10)
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    hf_specdec.prepack(target, measure=False)
    draft = hf_specdec.quantize_draft(draft, scheme="dynamic-int8")
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False), plain)
    for method in ("chain", "sequoia", "specexec"):
        out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config={"lean_target": True},
                              max_new_tokens=24, do_sample=False)
        assert torch.equal(out, plain), method


def test_a_dtype_this_cpu_cannot_pack_is_refused_with_the_fix(monkeypatch):
    """On an AVX2-only CPU oneDNN raises when asked to pack bfloat16 weights: prepack says so instead."""
    module = importlib.import_module("hf_specdec.kernels.prepack")
    monkeypatch.setattr(module, "packable_dtypes", lambda: (torch.bfloat16,))
    model = tiny_model("llama", 0)
    report = hf_specdec.prepack(model, measure=False)
    assert not report.packed and not is_prepacked(model)
    assert "cannot pack float32 weights on this CPU" in report.reason and "float32" in report.reason
    assert torch.float32 in packable_dtypes()  # the probe itself: float32 packs on every CPU with oneDNN


def test_prepack_keeps_packing_only_when_it_measures_faster(monkeypatch):
    module = importlib.import_module("hf_specdec.kernels.prepack")
    model = tiny_model("llama", 0)
    times = iter([{1: 10.0, 16: 20.0}, {1: 10.0, 16: 19.9}])  # before, after: not 5% faster
    monkeypatch.setattr(module, "_time", lambda model, sizes: next(times))
    report = hf_specdec.prepack(model)
    assert not report.packed and not is_prepacked(model) and "not faster" in report.reason
    times = iter([{1: 10.0, 16: 20.0}, {1: 5.0, 16: 12.0}])
    report = hf_specdec.prepack(model)
    assert report.packed and is_prepacked(model) and report.after_ms == {1: 5.0, 16: 12.0}


def test_models_that_cannot_be_prepacked_are_left_alone():
    model = tiny_model("llama", 0)
    quantized = hf_specdec.quantize_draft(copy.deepcopy(model), scheme="dynamic-int8")
    assert "no float32/bfloat16 nn.Linear" in can_prepack(quantized)
    report = hf_specdec.prepack(quantized)
    assert not report.packed and not is_prepacked(quantized)


@pytest.mark.parametrize("rows_hint", [1, 4])
def test_a_packing_for_other_pass_sizes_keeps_the_weights_and_losslessness(rows_hint):
    target, draft = tiny_model("qwen2", 0), tiny_model("qwen2", 1)
    ids = random_prompt(torch.Generator().manual_seed(5), 10)
    weights = {name: p.detach().clone() for name, p in target.state_dict().items()}
    assert hf_specdec.prepack(target, measure=False, rows_hint=rows_hint).packed and is_prepacked(target)
    assert kernels(target) == f"onednn-prepacked-{rows_hint}-rows"  # curves measured with 16-row packing differ
    assert all(torch.equal(target.state_dict()[k], v) for k, v in weights.items())  # the layout, not the values
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    for method in ("chain", "sequoia"):
        out = target.generate(ids, assistant_model=draft, speculation=method, max_new_tokens=20, do_sample=False)
        assert torch.equal(out, plain), method


def test_a_rows_hint_below_one_is_refused_before_anything_is_packed():
    model = tiny_model("llama", 0)
    with pytest.raises(ValueError, match="rows_hint must be at least 1"):
        hf_specdec.prepack(model, measure=False, rows_hint=0)
    assert not is_prepacked(model)
