"""Every way a user reaches generate speculates and stays lossless: pipeline, generation_config.json,
a Hub `custom_generate` folder, streamers.

"Speculating" is checked with a draft identical to the target (a copy, so counting the target's forward
calls counts only verification passes): each target pass must then yield several tokens.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import shutil
from pathlib import Path
from threading import Thread

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)
from transformers.generation.utils import GenerationMixin

import hf_specdec
from hf_specdec.integration import generate as integration
from hf_specdec.integration.generation_config import get_speculation, set_speculation
from tests.conftest import random_prompt, tiny_model
from tests.helpers.counting import ForwardCounter, with_greedy_plan

HUB = Path(__file__).resolve().parent.parent / "hub"
NEW = 24


@pytest.fixture
def models_():
    """(target, its exact copy as draft, forward counter on the target), the pair's greedy plan made."""
    target = tiny_model("llama", 0)
    draft = copy.deepcopy(target)
    with_greedy_plan(target, draft)
    counter = ForwardCounter(target)
    yield target, draft, counter
    counter.handle.remove()


# --- pipeline ------------------------------------------------------------------------------------------------


def test_pipeline_speculation_at_construction(models_, tokenizer):
    target, draft, counter = models_
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)(
        "w7 w8 w9", max_new_tokens=NEW, do_sample=False
    )
    counter.take()
    spec = pipeline(
        "text-generation",
        model=target,
        tokenizer=tokenizer,
        assistant_model=draft,
        speculation="tree",
        speculation_config={"widths": [2, 2, 1]},
        do_sample=False,
        max_new_tokens=NEW,
    )
    assert spec("w7 w8 w9") == plain
    assert counter.take() <= NEW // 3
    plain_ids = pipeline("text-generation", model=target, tokenizer=tokenizer)(
        "w7 w8 w9", max_new_tokens=NEW, do_sample=False, return_tensors=True
    )
    assert spec("w7 w8 w9", return_tensors=True)[0]["generated_token_ids"] == plain_ids[0]["generated_token_ids"]


def test_pipeline_speculation_per_call_with_chat_messages(models_, tokenizer):
    target, draft, counter = models_
    chat = pipeline("text-generation", model=target, tokenizer=tokenizer)
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8 w9 w10"}]
    plain = chat(messages, max_new_tokens=NEW, do_sample=False)
    chat(messages, max_new_tokens=NEW, do_sample=False, assistant_model=draft, speculation="tree")
    counter.take()  # the first call may look the pair's plan up (an online calibration runs target passes)
    spec = chat(messages, max_new_tokens=NEW, do_sample=False, assistant_model=draft, speculation="tree")
    assert spec == plain
    assert spec[0]["generated_text"][-1]["role"] == "assistant"
    assert counter.take() <= NEW // 3


def test_pipeline_sampling_defaults(models_, tokenizer, monkeypatch):
    """The text-generation pipeline samples by default (do_sample=True, temperature=0.7): speculation follows."""
    target, draft, counter = models_
    outputs = []
    original = target.generate

    def recording_generate(*args, **kwargs):
        outputs.append((kwargs, original(*args, return_dict_in_generate=True, **kwargs)))
        return outputs[-1][1]

    monkeypatch.setattr(target, "generate", recording_generate)
    chat = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft, speculation="tree")
    torch.manual_seed(0)
    reply = chat([{"role": "user", "content": "w8 w9"}], max_new_tokens=NEW)
    assert reply[0]["generated_text"][-1]["role"] == "assistant"
    ((kwargs, out),) = outputs
    assert kwargs["do_sample"] is True and kwargs["temperature"] == 0.7
    stats = out.speculation_stats
    assert stats.verifier != "greedy" and stats.new_tokens == NEW
    assert stats.target_forwards < NEW  # the loop's passes (a first call may also calibrate a plan for T=0.7)


# --- generation_config.json ----------------------------------------------------------------------------------


def _plain(model, ids):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize(
    "setting",
    ["tree", {"method": "tree", "widths": [3, 2]},
     {"method": "chain", "num_draft_tokens": 3, "confidence_threshold": 0}],
)
def test_generation_config_round_trip(tmp_path, setting):
    """`model.generation_config.speculation = ...`, saved and reloaded: generate(assistant_model=...) speculates."""
    target = tiny_model("qwen2", 0)
    ids = random_prompt(torch.Generator().manual_seed(1), 6)
    expected = _plain(target, ids)
    target.generation_config._from_model_config = False  # as a generation_config.json from the Hub (see below)
    target.generation_config.speculation = setting
    target.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["speculation"] == setting

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.generation_config.speculation == setting
    out = loaded.generate(
        ids, assistant_model=loaded, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, expected)
    method = setting if isinstance(setting, str) else setting["method"]
    assert out.speculation_stats.method == method and out.speculation_stats.target_forwards <= NEW // 3


def test_set_speculation_survives_a_config_derived_from_the_model(tmp_path):
    """Transformers drops unknown fields of a config made from the model config on reload; set_speculation doesn't."""
    target = tiny_model("llama", 0)
    assert target.generation_config._from_model_config
    config = set_speculation(target.generation_config, "tree", widths=[3, 2])
    assert config == hf_specdec.TreeConfig(widths=[3, 2])
    assert target.generation_config.speculation == {"method": "tree", "widths": [3, 2]}
    target.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert get_speculation(loaded.generation_config) == config
    ids = random_prompt(torch.Generator().manual_seed(2), 5)
    out = loaded.generate(
        ids, assistant_model=loaded, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, _plain(tiny_model("llama", 0), ids))
    assert out.speculation_stats.target_forwards <= NEW // 3


def test_saved_speculation_applies_only_with_a_draft(tmp_path):
    """A model saved with `speculation` still generates plainly (pipelines too) when no assistant_model is given."""
    target = tiny_model("llama", 0)
    ids = random_prompt(torch.Generator().manual_seed(2), 5)
    expected = _plain(target, ids)
    set_speculation(target.generation_config, "tree")
    target.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(_plain(loaded, ids), expected)


@pytest.mark.parametrize(
    ("method", "settings", "message"),
    [
        ("trees", {}, "Unknown speculation 'trees'"),
        ("tree", {"width": [3]}, "no setting"),
        ("tree", {"widths": [0]}, "positive integers"),
    ],
)
def test_set_speculation_validates_before_storing(method, settings, message):
    config = GenerationConfig()
    with pytest.raises(ValueError, match=message):
        set_speculation(config, method, **settings)
    assert getattr(config, "speculation", None) is None


@pytest.mark.parametrize("bad", ["trees", {"method": "tree", "width": [3, 2]}, {"widths": [3]}])
def test_bad_generation_config_json_names_the_field_and_the_fix(tmp_path, bad):
    target = tiny_model("llama", 0)
    target.save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "_from_model_config": False, "speculation": bad}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"generation_config\.json: the `speculation` field .*Fix: "):
        get_speculation(loaded.generation_config)
    ids = random_prompt(torch.Generator().manual_seed(3), 5)
    with pytest.raises(ValueError, match=r"generation_config\.json: the `speculation` field .*Fix: "):
        loaded.generate(ids, assistant_model=target, max_new_tokens=4, do_sample=False)


# --- custom_generate from the hub/ folder --------------------------------------------------------------------


@pytest.fixture
def hub_requirements_met(monkeypatch):
    """hub/custom_generate/requirements.txt names hf_specdec: from a source checkout that was not pip-installed,
    report this checkout's version the way an installed package would."""
    try:
        importlib.metadata.version("hf_specdec")
    except importlib.metadata.PackageNotFoundError:
        real = importlib.metadata.version
        monkeypatch.setattr(
            importlib.metadata, "version", lambda name: hf_specdec.__version__ if name == "hf_specdec" else real(name)
        )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("installed", [False, True], ids=["without-import", "after-import"])
@pytest.mark.parametrize("speculation", [None, "chain"])
def test_custom_generate_hub_folder(models_, hub_requirements_met, monkeypatch, installed, speculation):
    """`custom_generate=<hub folder>` runs hf_specdec (default "tree") whether or not the user imported it."""
    target, draft, counter = models_
    if not installed:  # what a user who never imported hf_specdec has: Transformers' own generate
        monkeypatch.setattr(GenerationMixin, "generate", integration._ORIGINAL_GENERATE)
    ids = random_prompt(torch.Generator().manual_seed(4), 6)
    expected = _plain(target, ids)
    counter.take()
    # a whole chain: the tiny models are never sure enough of a token for the default stop to draft a second one
    extra = {} if speculation is None else {"speculation": speculation,
                                            "speculation_config": {"confidence_threshold": 0}}
    out = target.generate(
        ids,
        custom_generate=str(HUB),
        trust_remote_code=True,
        assistant_model=draft,
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        **extra,
    )
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.method == (speculation or "tree")
    assert counter.take() <= NEW // 3 and out.speculation_stats.target_forwards <= NEW // 3


def test_model_repo_shipping_custom_generate(models_, hub_requirements_met, tmp_path):
    """hub/custom_generate copied into a model repo: from_pretrained(trust_remote_code=True) speculates by default."""
    target, draft, _ = models_
    target.save_pretrained(tmp_path)
    shutil.copytree(HUB / "custom_generate", tmp_path / "custom_generate")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    ids = random_prompt(torch.Generator().manual_seed(7), 6)
    out = loaded.generate(ids, assistant_model=draft, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _plain(target, ids))
    assert out.speculation_stats.method == "tree" and out.speculation_stats.target_forwards <= NEW // 3


def test_hub_folder_is_a_ready_repo():
    card = (HUB / "README.md").read_text()
    front_matter = card.split("---")[1]
    assert "library_name: transformers" in front_matter and "custom_generate" in front_matter
    assert "hf_specdec" in (HUB / "custom_generate" / "requirements.txt").read_text()
    assert "def generate(*args, model, **kwargs)" in (HUB / "custom_generate" / "generate.py").read_text().replace(
        ": Any", ""
    )


# --- streamers -----------------------------------------------------------------------------------------------


class CapturingTextStreamer(TextStreamer):
    """TextStreamer prints; keep what it would print instead."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


def test_text_streamer_receives_the_plain_text(models_, tokenizer):
    target, draft, counter = models_
    ids = random_prompt(torch.Generator().manual_seed(5), 6)
    plain, spec = CapturingTextStreamer(tokenizer), CapturingTextStreamer(tokenizer)
    expected = target.generate(ids, max_new_tokens=NEW, do_sample=False, streamer=plain)
    counter.take()
    out = target.generate(
        ids, assistant_model=draft, speculation="tree", max_new_tokens=NEW, do_sample=False, streamer=spec
    )
    assert torch.equal(out, expected)
    assert counter.take() <= NEW // 3
    assert spec.text == plain.text == tokenizer.decode(expected[0, ids.shape[1] :])


def test_text_iterator_streamer_in_a_thread(models_, tokenizer):
    target, draft, counter = models_
    ids = random_prompt(torch.Generator().manual_seed(6), 6)
    expected = _plain(target, ids)
    counter.take()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    kwargs = dict(assistant_model=draft, speculation="tree", max_new_tokens=NEW, do_sample=False, streamer=streamer)
    thread = Thread(target=target.generate, args=(ids,), kwargs=kwargs)
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert counter.take() <= NEW // 3
    assert "".join(pieces) == tokenizer.decode(expected[0, ids.shape[1] :])
    assert len([p for p in pieces if p]) > 1  # it streamed, rather than arriving in one piece at the end
