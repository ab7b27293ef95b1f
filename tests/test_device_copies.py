"""A target split over devices (accelerate device_map): each tree pass puts its mask and positions once on each device
its layers run on, not once per layer (hf_specdec/runtime/device_copies.py); a target on one device gets no hooks."""

from __future__ import annotations

import types
from collections import Counter

import pytest
import torch

from hf_specdec.runtime import device_copies
from hf_specdec.runtime.device_copies import DeviceCopies
from tests.conftest import random_prompt, tiny_model

NEW = 20


def four_layer_llama() -> torch.nn.Module:
    return tiny_model("llama", 0, num_hidden_layers=4)


def place(model: torch.nn.Module, devices: dict[str, torch.device]) -> None:
    """What accelerate's dispatch leaves on each placed module: a hook naming its execution device (here without
    moving anything, so the split runs on one CPU)."""
    for name, device in devices.items():
        model.get_submodule(name)._hf_hook = types.SimpleNamespace(execution_device=device)


def test_one_copy_per_device_and_pass_and_identical_output(monkeypatch):
    target = four_layer_llama()
    ids = random_prompt(torch.Generator().manual_seed(1), 7)
    plain = target.generate(ids, do_sample=False, max_new_tokens=NEW)
    first, second = torch.device("cpu"), torch.device("cpu", 1)  # a stand-in for a second GPU
    place(target, {"model.embed_tokens": first, "model.layers.0": first, "model.layers.1": first,
                   "model.layers.2": second, "model.layers.3": second, "model.norm": second, "lm_head": second})
    copies, passes = Counter(), Counter()
    monkeypatch.setattr(device_copies, "copy_to",
                        lambda tensor, device: copies.update([str(device)]) or tensor.clone())
    target.register_forward_pre_hook(lambda *_: passes.update(["target"]))
    out = target.generate(ids, assistant_model=tiny_model("llama", 0), speculation="tree", max_new_tokens=NEW,
                          speculation_config={"widths": [2, 1]}, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    tree_passes = passes["target"] - 1  # the prompt's pass is plain (a 2-D mask made inside the model)
    assert tree_passes == out.speculation_stats.target_forwards
    # per pass: the mask, the position ids, cos and sin, each copied once to the second device (two layers there)
    assert set(copies) == {"cpu:1"} and copies["cpu:1"] == 4 * tree_passes
    assert not any(layer._forward_pre_hooks for layer in target.model.layers)  # hooks live for one pass only


def test_a_model_on_one_device_gets_no_hooks():
    target = four_layer_llama()
    assert DeviceCopies.of(target) is None
    place(target, {"model.layers.0": torch.device("cpu"), "model.layers.3": torch.device("cpu")})
    assert DeviceCopies.of(target) is None


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_split_over_two_gpus_is_identical_with_one_copy_per_device(monkeypatch):
    from accelerate import dispatch_model

    target = four_layer_llama()
    ids = random_prompt(torch.Generator().manual_seed(2), 7).cuda()
    plain = target.cuda().generate(ids, do_sample=False, max_new_tokens=NEW)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    target = dispatch_model(target.cpu(), device_map=device_map)
    made = device_copies.copy_to
    copies = Counter()
    monkeypatch.setattr(device_copies, "copy_to",
                        lambda tensor, device: copies.update([str(device)]) or made(tensor, device))
    out = target.generate(ids, assistant_model=tiny_model("llama", 0).cuda(), speculation="tree",
                          speculation_config={"widths": [2, 1]}, max_new_tokens=NEW, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert set(copies) == {"cuda:1"} and copies["cuda:1"] <= 5 * out.speculation_stats.target_forwards
