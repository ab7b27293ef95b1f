"""Targets quantized through Transformers' own route (torchao via TorchAoConfig, int8 weight-only and int8 dynamic):
every method stays greedy token-identical to plain `generate` on the same quantized target, and really speculates.

The target is loaded as a user would (`from_pretrained(folder, quantization_config=...)`); the draft is the float
model it was quantized from, so it agrees with the target on nearly every token and trees are accepted deep.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_specdec import plan_tree, prepack
from hf_specdec.kernels.prepack import PackedLinear
from hf_specdec.methods.sequoia.plan_file import pair_placement
from hf_specdec.methods.sequoia.store import plan_filename
from hf_specdec.plan.latency import placement
from hf_specdec.runtime.model_info import quantization
from hf_specdec_tools.bench.target_quantization import ROUTES, quantization_config
from tests.conftest import random_prompt, tiny_model

pytest.importorskip("torchao", reason="torchao is a test requirement (pyproject [test])")

TESTED_ROUTES = tuple(ROUTES)
METHODS = {
    "chain": {"num_draft_tokens": 4, "confidence_threshold": 0.4},  # Transformers' stop: sizing follows timings
    "tree": {},
    "sequoia": {"plan": plan_tree([0.7, 0.15, 0.05], 16, 6)},
    "specexec": {"budget": 16, "max_depth": 6},
    "staged": {"budget": 16},  # fixed: trees sized every step follow measured timings, and the rate below with them
    "ngram": {},  # prompt lookup: no draft model, so only identity is asserted
}


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    model = tiny_model("qwen2", 0)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder)
    return folder


def load(folder, route: str | None):
    kwargs = {} if route is None else {"quantization_config": quantization_config(route)}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=TESTED_ROUTES)
def quantized(request, float_folder):
    return request.param, load(float_folder, request.param), load(float_folder, None)


def test_the_route_really_quantizes(quantized):
    route, target, float_model = quantized
    weight = target.model.layers[0].mlp.up_proj.weight
    assert quantization(target) is not None and quantization(float_model) is None
    assert type(weight.data) is not torch.Tensor or not weight.dtype.is_floating_point  # a quantized tensor
    ids = random_prompt(torch.Generator().manual_seed(0), 8)
    with torch.no_grad():
        assert not torch.equal(target(ids).logits, float_model(ids).logits)  # different numbers: really int8


@pytest.mark.parametrize("method", sorted(METHODS))
def test_identical_to_plain_on_the_same_quantized_target(quantized, method):
    _, target, draft = quantized
    for seed in range(2):
        ids = random_prompt(torch.Generator().manual_seed(seed), 8)
        expected = target.generate(ids, max_new_tokens=32, do_sample=False)
        out = target.generate(ids, assistant_model=None if method == "ngram" else draft, speculation=method,
                              speculation_config=METHODS[method] or None, max_new_tokens=32, do_sample=False,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected), (method, seed)
        stats = out.speculation_stats
        if method != "ngram":
            assert stats.target_forwards / stats.new_tokens <= 0.5, stats.tokens_per_step


def test_quantized_targets_get_plans_and_curves_of_their_own(quantized):
    """A quantized target's passes cost what its kernels cost: its placement (the key of stored latency curves and
    Sequoia plans) names the quantization, and a plain model's placement is unchanged (no new key)."""
    route, target, float_model = quantized
    assert placement(target)["quantization"] == quantization(target)
    assert "quantization" not in placement(float_model)
    assert placement(target) != placement(float_model)
    assert "draft_quantization" not in pair_placement(float_model, float_model)
    assert plan_filename(target, float_model, 0.0) != plan_filename(float_model, float_model, 0.0)  # no overwrite


def test_prepack_leaves_quantized_layers_alone(float_folder):
    """torchao's weights report the float dtype they compute in; prepacking must not unpack them into oneDNN."""
    target = load(float_folder, "int8")
    ids = random_prompt(torch.Generator().manual_seed(3), 8)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    prepack(target, measure=False)
    assert not isinstance(target.model.layers[0].mlp.up_proj, PackedLinear)
    assert type(target.model.layers[0].mlp.up_proj.weight.data) is not torch.Tensor
    assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False), expected)


def test_pytorch_dynamic_int8_target_is_not_lossless_to_itself():
    """Why `quantize_draft` is offered for drafts only: PyTorch's dynamic int8 Linear quantizes a pass's activations
    with one scale for all its rows, so a node's logits depend on the tree it is verified in, and speculation's
    greedy output drifts from plain decoding on the same quantized model (the routes above quantize per token)."""
    from hf_specdec import quantize_draft

    float_model = tiny_model("qwen2", 0)
    target = quantize_draft(float_model, scheme="dynamic-int8")
    differing = 0
    for seed in range(6):
        ids = random_prompt(torch.Generator().manual_seed(seed), 8)
        expected = target.generate(ids, max_new_tokens=32, do_sample=False)
        out = target.generate(ids, assistant_model=float_model, speculation="specexec",
                              speculation_config={"budget": 16}, max_new_tokens=32, do_sample=False)
        differing += not torch.equal(out, expected)
    assert differing > 0


def test_unknown_or_missing_routes_are_named(monkeypatch):
    with pytest.raises(ValueError, match="Unknown target quantization 'int3'.*int8"):
        quantization_config("int3")
    monkeypatch.setitem(ROUTES, "int8", dataclasses.replace(ROUTES["int8"], package="no_such_package_here"))
    with pytest.raises(ImportError, match="int8 cannot run here: no_such_package_here is not installed"):
        quantization_config("int8")


def test_the_command_line_offers_every_route():
    from hf_specdec.kernels.quantize import SCHEMES
    from hf_specdec_tools.bench.cli import DRAFT_SCHEMES, QUANTIZE_CHOICES
    from hf_specdec_tools.bench.target_quantization import CHOICES

    assert QUANTIZE_CHOICES == CHOICES
    assert DRAFT_SCHEMES == tuple(SCHEMES)  # and every draft scheme


@pytest.mark.parametrize(("settings", "expected"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes:4bit"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes:8bit"),
    ({"quant_method": "gguf", "dequantize": True}, None),
])
def test_quantization_names_tell_kinds_apart(settings, expected):
    """Latency curves and plans are keyed by this name: two kinds of weights must not share one."""
    model = tiny_model("qwen2", 0)
    model.config.quantization_config = settings
    assert quantization(model) == expected
