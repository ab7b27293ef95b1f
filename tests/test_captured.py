"""A step captured whole (`captured=True`, decoding/captured.py): greedy output identical to plain static-cache
`generate` for chain, tree and sequoia shapes over several families; one host read a step however many levels; a
stop inside an accepted block and the returned cache as plain's; the step compiled whole; every call it cannot take
refused before anything is decoded."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TextStreamer

from hf_specdec.accept.kv_cache import cache_length
from hf_specdec.core.releases import output_cache
from hf_specdec.decoding import captured
from hf_specdec.methods.sequoia.dp import plan_tree
from tests.conftest import random_prompt
from tests.families import family
from tests.helpers.family_cases import new_tokens, prompt, tiny
from tests.roundtrips import count_round_trips

#: fixed shapes, several levels each: what a captured step drafts
SHAPES = {
    "chain": {"num_draft_tokens": 4, "confidence_threshold": 0, "per_step": False},
    "tree": {"widths": [3, 2], "per_step": False},
    "sequoia": {"plan": plan_tree([0.6, 0.2, 0.1, 0.05], 16, 6)},
}
FAMILIES = ["Llama", "Mistral (sliding window)", "Gemma 3 (text)", "GPT-2"]


def captured_call(target, draft, ids, n, method, **kwargs):
    return target.generate(ids, assistant_model=draft, speculation=method,
                           speculation_config={**SHAPES[method], "captured": True, "guard": False},
                           do_sample=False, max_new_tokens=n, cache_implementation="static",
                           return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("method", sorted(SHAPES))
@pytest.mark.parametrize("name", FAMILIES)
def test_identical_to_plain_static_generate(name, method):
    """Every draft accepted (the draft is the target: the shape's full depth every step) and another draft (short
    paths, a leaf unforwarded or a mismatch at any level): plain's tokens and plain's cache length."""
    target = tiny(name)
    ids, n = prompt(), new_tokens(family(name))
    expected = target.generate(ids, do_sample=False, max_new_tokens=n, cache_implementation="static")
    for draft in (copy.deepcopy(target), tiny(name, seed=1)):
        out = captured_call(target, draft, ids, n, method)
        assert torch.equal(out.sequences, expected)
        assert cache_length(output_cache(out)) == expected.shape[1] - 1
        stats = out.speculation_stats
        assert sum(stats.tokens_per_step) == n and stats.target_forwards == len(stats.tokens_per_step)
        assert stats.captured and stats.time_engine is None
    # the target as its draft: every step keeps the shape's whole deepest path, as the loop's do (a draft cache out of
    # step with the sequence would propose other tokens, and the steps would keep less)
    draft = copy.deepcopy(target)
    same = captured_call(target, draft, ids, n, method).speculation_stats
    loop = target.generate(ids, assistant_model=draft, speculation=method, do_sample=False, max_new_tokens=n,
                           speculation_config={**SHAPES[method], "guard": False}, cache_implementation="static",
                           return_dict_in_generate=True).speculation_stats
    assert same.tokens_per_step == loop.tokens_per_step and same.target_forwards < n / 2, same.tokens_per_step


@pytest.mark.parametrize("method", sorted(SHAPES))
def test_prompts_of_one_and_two_tokens_and_a_draft_the_target_disagrees_with(qwen2_pair, method):
    """The draft's first catch-up carries the prompt's last token (a one-token prompt: the draft reads nothing
    before the first step), and a draft whose tokens are mostly rejected keeps its cache in step: plain's output."""
    target, draft = qwen2_pair
    for length in (1, 2, 9):
        ids = random_prompt(torch.Generator().manual_seed(length), length)
        expected = target.generate(ids, do_sample=False, max_new_tokens=24, cache_implementation="static")
        out = captured_call(target, draft, ids, 24, method)
        assert torch.equal(out.sequences, expected), length


@pytest.mark.parametrize("method", sorted(SHAPES))
def test_a_step_reads_the_host_once_whatever_its_levels(qwen2_pair, method, monkeypatch):
    """The verdict's read (the accepted count, the bonus and the path's tokens) is the step's only one: the draft's
    levels, the verdict and both compactions run on the device."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
    with count_round_trips(target, qwen2_pair[1]) as counts:
        out = captured_call(target, copy.deepcopy(target), ids, 30, method)
    assert torch.equal(out.sequences, expected)
    assert len(counts.steps) == out.speculation_stats.target_forwards > 2
    assert all(step.draft_passes >= 2 for step in counts.steps)  # several levels drafted every step
    assert all(step.reads == 1 for step in counts.steps), [(s.reads, s.draft_passes) for s in counts.steps]


def test_a_stop_inside_an_accepted_block_lands_where_plains_does(qwen2_pair):
    """An end-of-sequence token that the draft gets right mid-path: the output stops on it and the returned cache
    holds the sequence but its last token, as plain's; the streamer gets exactly the emitted tokens."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    free = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
    eos = int(free[0, ids.shape[1] + 6])  # the seventh new token: inside a block of the full-depth chain
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static",
                               eos_token_id=eos, return_dict_in_generate=True)
    streamed = []

    class Streamer(TextStreamer):
        def __init__(self):
            pass

        def put(self, value):
            streamed.extend(value.flatten().tolist())

        def end(self):
            streamed.append("end")

    out = captured_call(target, copy.deepcopy(target), ids, 30, "chain", eos_token_id=eos, streamer=Streamer())
    assert torch.equal(out.sequences, expected.sequences) and out.sequences[0, -1] == eos
    assert cache_length(output_cache(out)) == cache_length(output_cache(expected)) == out.sequences.shape[1] - 1
    assert streamed == out.sequences[0].tolist() + ["end"]


@pytest.mark.slow
def test_the_step_compiled_whole_gives_the_same_tokens(qwen2_pair, monkeypatch):
    """`torch.compile` over the whole step as one graph (`fullgraph=True` raises at any break; inductor on the CPU
    here, where a GPU call compiles it with the call's compile config, mode="reduce-overhead" by default): plain's
    tokens, every step run by the compiled function."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=20, cache_implementation="static")
    calls = []
    loop = captured.captured_loop

    def compiled_loop(*args, **kwargs):
        def compile_step(step):
            compiled = torch.compile(step, backend="inductor", fullgraph=True)
            return lambda: calls.append(1) or compiled()
        return loop(*args, **{**kwargs, "compile_step": compile_step})

    monkeypatch.setattr("hf_specdec.integration.generate.captured_loop", compiled_loop)
    torch._dynamo.reset()
    out = captured_call(target, copy.deepcopy(target), ids, 20, "tree")
    assert torch.equal(out.sequences, expected)
    assert len(calls) == out.speculation_stats.target_forwards


REFUSED = [
    ({"do_sample": True}, {}, "greedy only"),
    ({"cache_implementation": "dynamic"}, {}, "cache_implementation='static'"),
    ({}, {"guard": True}, "guard=False"),
    ({"repetition_penalty": 1.2}, {}, "RepetitionPenaltyLogitsProcessor"),
    ({"output_scores": True, "return_dict_in_generate": True}, {}, "output scores"),
    ({"stop_strings": ["w9"]}, {}, "stop strings"),
]


@pytest.mark.parametrize(("call", "settings", "says"), REFUSED)
def test_calls_it_cannot_take_are_refused_before_anything_is_decoded(qwen2_pair, stop_tokenizer, call, settings,
                                                                     says):
    target, draft = qwen2_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    streamed = []

    class Streamer(TextStreamer):
        def __init__(self):
            pass

        def put(self, value):
            streamed.append(value)

        def end(self):
            streamed.append("end")

    kwargs = {"do_sample": False, "cache_implementation": "static", "max_new_tokens": 8, **call}
    with pytest.raises(ValueError, match="captured=True cannot decode this call") as refused:
        target.generate(ids, assistant_model=draft, speculation="tree", tokenizer=stop_tokenizer, streamer=Streamer(),
                        speculation_config={**SHAPES["tree"], "captured": True, "guard": False, **settings}, **kwargs)
    assert says in str(refused.value) and not streamed


def test_a_shape_sized_every_step_and_a_batch_are_refused(qwen2_pair):
    target, draft = qwen2_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    with pytest.raises(ValueError, match="sized every step"):
        target.generate(ids, assistant_model=draft, speculation="sequoia", do_sample=False, max_new_tokens=8,
                        cache_implementation="static", speculation_config={"captured": True, "guard": False})
    with pytest.raises(ValueError, match="a batch of 2"):
        target.generate(ids.repeat(2, 1), assistant_model=draft, speculation="tree", do_sample=False,
                        max_new_tokens=8, speculation_config={**SHAPES["tree"], "captured": True, "guard": False})
    with pytest.raises(ValueError, match="captured must be True or False"):
        target.generate(ids, assistant_model=draft, speculation="tree", speculation_config={"captured": "yes"})
