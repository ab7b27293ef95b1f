"""A low-bit draft (PyTorch dynamic int8, or int4/int8 weight-only) proposes; the target still decides: output
unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_specdec.kernels.quantize as quantize_module
from hf_specdec import quantize_draft
from hf_specdec.kernels import weight_only
from hf_specdec.kernels.quantize import BROAD_ROWS, broad_rows_here, faster_prefix, faster_suffix, is_quantized
from hf_specdec.kernels.row_dispatch import RowDispatchLinear, set_broad_rows, set_narrow_rows, split_by_rows
from hf_specdec.kernels.weight_only import Int4Linear, Int8Linear
from hf_specdec.runtime.model_info import quantization
from tests.conftest import random_prompt, tiny_model


@pytest.mark.parametrize("method", ["chain", "tree", "specexec", "sequoia"])
def test_quantized_draft_is_lossless_and_still_accepted(method):
    target = tiny_model("qwen2", 0)
    draft = quantize_draft(target, scheme="dynamic-int8")
    assert is_quantized(draft) and not is_quantized(target)
    assert type(draft.model.layers[0].mlp.up_proj).__module__.startswith("torch.ao.nn.quantized")
    assert target.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # the original is untouched
    settings = {"budget": 16} if method == "specexec" else {"confidence_threshold": 0} if method == "chain" else None
    for seed in range(3):
        ids = random_prompt(torch.Generator().manual_seed(seed), 6)
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config=settings,
                              max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        if method != "sequoia":  # sequoia may rightly size a tree-less plan for a draft as slow as the target
            assert out.speculation_stats.mean_tokens_per_step > 2  # int8 noise rarely changes the draft's choice


def write_gguf(model, path) -> None:
    """`model` (a Qwen2) as a float32 GGUF file, tensors named as llama.cpp names them (no permutation for qwen2)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_quantize_a_draft_loaded_from_gguf(tmp_path):
    """`from_pretrained(..., gguf_file=...)` flags the model quantized (PreTrainedModel.float() refuses it), though
    its weights are plain floats: quantize_draft still makes an int8 copy, and decoding stays lossless."""
    source = tiny_model("qwen2", 1)
    write_gguf(source, tmp_path / "draft.gguf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="draft.gguf").eval()
    ids = random_prompt(torch.Generator().manual_seed(0), 6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits)  # the file holds this model
    assert loaded.is_quantized
    draft = quantize_draft(loaded)
    assert is_quantized(draft) and loaded.is_quantized  # the loaded model is left as it was
    target = tiny_model("qwen2", 0)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=draft, speculation="tree", max_new_tokens=24,
                                       do_sample=False), expected)


@pytest.mark.parametrize("scheme", ["int4", "int8-weight-only", "mixed"])
def test_weight_only_drafts_are_lossless(scheme):
    """aten's fused weight-only kernels run the draft in bfloat16; the target (float32) still decides every token."""
    target = tiny_model("llama", 0)
    draft = quantize_draft(target, scheme=scheme)
    kind = {"int4": Int4Linear, "int8-weight-only": Int8Linear, "mixed": RowDispatchLinear}[scheme]
    assert isinstance(draft.model.layers[0].mlp.up_proj, kind) and quantization(draft) == scheme
    assert type(target.model.layers[0].mlp.up_proj) is torch.nn.Linear  # the original is untouched
    for method, settings in (("chain", {"confidence_threshold": 0.4}), ("specexec", {"budget": 16, "guard": False})):
        ids = random_prompt(torch.Generator().manual_seed(3), 6)
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config=settings,
                              max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.speculation_stats.mean_tokens_per_step > 1.5  # the low-bit draft still agrees with the target


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features", [48, 41])  # 41: not a multiple of the int4 kernel's row block of 16
def test_weight_only_layers_compute_their_dequantized_weights(bits, out_features):
    linear = torch.nn.Linear(256, out_features, bias=True)
    layer = Int4Linear(linear, 64) if bits == 4 else Int8Linear(linear)
    x = torch.randn(2, 5, 256)
    step = (linear.weight.abs().amax() * 2 / (15 if bits == 4 else 254)).item()  # a weight's largest rounding, x2
    bound = step * x.abs().sum(-1, keepdim=True) + 0.02 * linear(x).abs()  # + bfloat16 rounding
    out = layer(x).float()
    assert out.shape == (2, 5, out_features) and bool(((out - linear(x)).abs() <= bound).all())
    assert not torch.equal(out, linear(x))  # it really is another (low-bit) computation


def test_mixed_draft_takes_int4_for_narrow_passes_and_int8_for_wide_ones():
    """Each layer of a "mixed" draft keeps both copies; a pass of at most `narrow_rows` rows runs the int4 one."""
    draft = quantize_draft(tiny_model("llama", 0), scheme="mixed")
    layer = draft.model.layers[0].mlp.up_proj
    assert isinstance(layer.wide, torch.ao.nn.quantized.dynamic.Linear) and isinstance(layer.narrow, Int4Linear)
    assert draft.dtype == torch.bfloat16 and 0 <= layer.narrow_rows <= 4  # as measured on this machine
    set_narrow_rows(draft, 2)
    x = torch.randn(1, 3, layer.in_features, dtype=torch.bfloat16)
    for rows, kernel in ((1, layer.narrow), (2, layer.narrow), (3, layer.wide)):
        expected = kernel(x[:, :rows].float() if kernel is layer.wide else x[:, :rows]).to(torch.bfloat16)
        assert torch.equal(layer(x[:, :rows]), expected)
    assert not torch.equal(layer.narrow(x[:, :1]).float(), layer.wide(x[:, :1].float()))  # two kernels really differ


def test_mixed_draft_takes_bfloat16_weights_for_its_broadest_passes_but_not_in_its_output_layer():
    """Every layer of a "mixed" draft but its output layer also keeps its weights in bfloat16; passes of at least
    `broad_rows` rows (measured here: one of `BROAD_ROWS`, or 0 for never) run on them, narrower ones as before."""
    target = tiny_model("llama", 0)
    draft = quantize_draft(target, scheme="mixed")
    layers = [module for module in draft.modules() if isinstance(module, RowDispatchLinear)]
    head = draft.get_output_embeddings()
    assert isinstance(head, RowDispatchLinear) and head.broad_weight is None
    assert all(layer.broad_weight is not None for layer in layers if layer is not head)
    assert len({layer.broad_rows for layer in layers}) == 1 and layers[0].broad_rows in (0, *BROAD_ROWS)
    layer = draft.model.layers[0].mlp.up_proj
    assert torch.equal(layer.broad_weight, target.model.layers[0].mlp.up_proj.weight.bfloat16())
    set_narrow_rows(draft, 1)
    set_broad_rows(draft, 3)
    x = torch.randn(1, 4, layer.in_features, dtype=torch.bfloat16)
    for rows, kernel in ((1, "int4"), (2, "int8"), (3, "bfloat16"), (4, "bfloat16")):
        expected = {"int4": lambda v: layer.narrow(v), "int8": lambda v: layer.wide(v.float()),
                    "bfloat16": lambda v: torch.nn.functional.linear(v, layer.broad_weight)}[kernel]
        assert torch.equal(layer(x[:, :rows]), expected(x[:, :rows]).to(torch.bfloat16)), (rows, kernel)
    assert not torch.equal(layer.wide(x.float()).bfloat16(), torch.nn.functional.linear(x, layer.broad_weight))
    set_broad_rows(draft, 0)  # never
    assert torch.equal(layer(x), layer.wide(x.float()).to(torch.bfloat16))
    assert broad_rows_here(draft, rows=(2, 8), repeats=1) in (0, 2, 8)
    ids = random_prompt(torch.Generator().manual_seed(0), 40)
    set_broad_rows(draft, 16)  # the prompt's pass on bfloat16 weights, the steps' passes on int4 and int8
    out = target.generate(ids, assistant_model=draft, speculation="chain", max_new_tokens=16, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=16, do_sample=False))


def test_broad_rows_start_where_bfloat16_wins_at_every_wider_pass():
    """The bfloat16 copies take over from the narrowest measured pass beyond which they never lose: a win at 32 rows
    followed by a loss at 64 does not count; no win at the widest, never."""
    rows = (16, 32, 64, 128)
    assert faster_suffix(rows, [3, 3, 2, 2], [1, 2, 3, 4]) == 64
    assert faster_suffix(rows, [3, 1, 4, 2], [1, 2, 3, 4]) == 128
    assert faster_suffix(rows, [0.5, 1, 2, 3], [1, 2, 3, 4]) == 16
    assert faster_suffix(rows, [0.5, 1, 2, 5], [1, 2, 3, 4]) == 0


@pytest.mark.parametrize("native", [True, False])
def test_auto_scheme_is_mixed_where_bfloat16_is_native(monkeypatch, native):
    monkeypatch.setattr(quantize_module, "native_bfloat16", lambda cuda: native)
    draft = quantize_draft(tiny_model("llama", 0))
    assert quantization(draft) == ("mixed" if native else "dynamic-int8")


def test_mixed_layers_without_an_int4_group_size_take_int8_in_a_bfloat16_model():
    """A width no int4 group divides (40) keeps only the int8 kernel, which still gets float32 activations."""
    from torch.ao.quantization import quantize_dynamic

    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Linear(64, 8))
    assert split_by_rows(model, 4) == 1  # only the 64-wide input has an int4 copy
    quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    torch.nn.Module.to(model, torch.bfloat16)
    assert model[0].narrow is None and isinstance(model[1].narrow, Int4Linear)
    out = model(torch.randn(1, 40, dtype=torch.bfloat16))
    assert out.shape == (1, 8) and out.dtype == torch.bfloat16


def test_mixed_threshold_is_the_prefix_where_int4_wins():
    rows = (1, 2, 3, 4)
    assert faster_prefix(rows, [1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 3.5, 3.9]) == 3
    assert faster_prefix(rows, [1.0, 3.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]) == 1  # a loss ends the prefix
    assert faster_prefix(rows, [2.0, 1.0, 1.0, 1.0], [1.0, 2.0, 2.0, 2.0]) == 0  # never int4 where one row loses


def test_unknown_or_unavailable_scheme_is_named(monkeypatch):
    target = tiny_model("llama", 0)
    with pytest.raises(ValueError, match="Unknown draft quantization scheme 'int3': choose one of auto, dynamic-int8"):
        quantize_draft(target, scheme="int3")
    monkeypatch.setitem(weight_only.KERNELS, 4, ("_weight_int4pack_mm_for_cpu", "_no_such_int4_kernel"))
    for scheme in ("int4", "mixed"):
        with pytest.raises(RuntimeError, match="no aten._no_such_int4_kernel. Use scheme='dynamic-int8'"):
            quantize_draft(target, scheme=scheme)
    assert type(target.model.layers[0].mlp.up_proj) is torch.nn.Linear and quantization(target) is None
