"""Each example's `main` runs on tiny models: lossless, and speculating (a draft identical to the target)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import pipeline

from hf_specdec.plan import validate_parents
from tests.conftest import tiny_model
from tests.helpers.counting import ForwardCounter, with_greedy_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NEW = 24


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def copy_pair():
    """(target, an exact copy as draft, a forward counter on the target), the pair's greedy plan made."""
    target = tiny_model("qwen2", 0)
    draft = copy.deepcopy(target)
    with_greedy_plan(target, draft)
    counter = ForwardCounter(target)
    yield target, draft, counter
    counter.handle.remove()


def test_every_example_has_a_main():
    names = sorted(path.stem for path in EXAMPLES.glob("*.py"))
    assert names == ["calibrate_plan", "offload_big_model", "pipeline_chat", "quickstart", "streaming_chat"]
    for name in names:
        assert callable(load_example(name).main)


def test_quickstart(copy_pair, tokenizer):
    target, draft, _ = copy_pair
    result = load_example("quickstart").main(target, draft, tokenizer, prompt="w7 w8 w9", max_new_tokens=NEW)
    assert result["identical"]
    assert result["stats"].new_tokens == NEW and result["stats"].target_forwards <= NEW // 3


def test_pipeline_chat(copy_pair, tokenizer):
    target, draft, counter = copy_pair
    turns = ["w7 w8", "w9 w10 w11"]
    conversation = load_example("pipeline_chat").main(target, draft, tokenizer, turns=turns, max_new_tokens=NEW)
    assert counter.take() <= 2 * (NEW // 3)  # two replies
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    messages = [conversation[0]]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        messages = plain(messages, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
    assert conversation == messages


def test_streaming_chat(copy_pair, tokenizer):
    target, draft, counter = copy_pair
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    text, out = load_example("streaming_chat").main(target, draft, tokenizer, messages=messages, max_new_tokens=NEW)
    assert counter.take() <= NEW // 3
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    plain = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out.sequences, plain)
    assert text == tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)


def test_calibrate_plan(copy_pair, tokenizer):
    target, draft, _ = copy_pair
    prompts = ["w7 w8 w9", "w10 w11", "w12 w13 w14 w15"]
    result = load_example("calibrate_plan").main(
        target, draft, tokenizer, prompts=prompts, max_budget=8, max_depth=5, max_new_tokens=NEW,
        latency_sizes=(1, 4, 8),
    )
    plan = result["plan"]  # reloaded from its JSON file
    assert plan.acceptance[0] == pytest.approx(1.0)  # the draft is the target: its first choice always wins
    validate_parents(plan.parents)
    assert plan.tree.widths_per_level() == [1] * len(plan.tree.widths_per_level())  # certain acceptance: a chain
    assert result["identical"]
    stats = result["stats"]
    assert stats.plan_source.startswith("plan file")
    assert stats.mean_tokens_per_step == pytest.approx(len(plan.parents), abs=1)  # every drafted token accepted


def test_offload_big_model(tmp_path, tokenizer):
    """Layers really go to disk (`hf_device_map`), and tree decoding on the offloaded target equals plain on it."""
    target = tiny_model("llama", 0, num_hidden_layers=6)
    target.save_pretrained(tmp_path / "target")
    # Room for the embeddings and two of the six layers in memory: the other layers go to disk.
    result = load_example("offload_big_model").main(
        str(tmp_path / "target"),
        copy.deepcopy(target),
        tokenizer,
        str(tmp_path / "offload"),
        max_memory=120_000,
        prompt="w7 w8 w9",
        max_new_tokens=NEW,
    )
    device_map = result["target"].hf_device_map
    places = [device_map[f"model.layers.{i}"] for i in range(target.config.num_hidden_layers)]
    assert places == ["cpu", "cpu", "disk", "disk", "disk", "disk"], device_map
    # An offloaded layer holds no weights in memory: accelerate loads them from disk for each forward pass.
    assert result["target"].model.layers[-1].mlp.up_proj.weight.device.type == "meta"
    assert result["identical"]
    assert result["stats"].target_forwards <= NEW // 3
    ids = tokenizer("w7 w8 w9", return_tensors="pt").input_ids
    assert torch.equal(result["plain"], target.generate(ids, max_new_tokens=NEW, do_sample=False))
