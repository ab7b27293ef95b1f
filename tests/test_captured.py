"""A step captured whole (`captured=True`, decoding/captured.py): greedy output identical to plain static-cache
`generate` for chain, tree and sequoia shapes and specexec's trees grown on the device, over several families;
sampling exactly plain sampling's distribution; one host read a step however many levels, greedy and sampled; a stop
inside an accepted block and the returned cache as plain's; the step compiled whole; every call it cannot take refused
before anything is decoded."""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from transformers import (
    CompileConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TextStreamer,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec.accept.kv_cache import cache_length
from hf_specdec.core.releases import output_cache
from hf_specdec.decoding import captured
from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.plan.shape_sizing import CAPTURED_SIZES
from tests.conftest import random_prompt
from tests.families import family
from tests.helpers.exactness import chi_square_pvalue, total_variation
from tests.helpers.family_cases import new_tokens, prompt, tiny
from tests.helpers.plain_steps import plain_steps_where
from tests.helpers.sampling import PROMPT, SAMPLES, SAMPLING, VOCAB, joint_of, sampling_pair
from tests.roundtrips import count_round_trips

#: fixed shapes, several levels each: what a captured step drafts
SHAPES = {
    "chain": {"num_draft_tokens": 4, "confidence_threshold": 0, "per_step": False},
    "tree": {"widths": [3, 2], "per_step": False},
    "sequoia": {"plan": plan_tree([0.6, 0.2, 0.1, 0.05], 16, 6)},
}
#: trees grown best first on the device, of a fixed budget
GROWN = {"specexec": {"budget": 16}}
EVERY_SHAPE = {**SHAPES, **GROWN}
FAMILIES = ["Llama", "Mistral (sliding window)", "Gemma 3 (text)", "GPT-2"]


def captured_call(target, draft, ids, n, method, **kwargs):
    kwargs = {"do_sample": False, **kwargs}
    return target.generate(ids, assistant_model=draft, speculation=method,
                           speculation_config={**EVERY_SHAPE[method], "captured": True, "guard": False},
                           max_new_tokens=n, cache_implementation="static", return_dict_in_generate=True, **kwargs)


#: what a captured sampled step processes rows with: the row-wise processors (`logits.node_ids.ROW_WISE`)
ROW_WISE_SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 6, "top_p": 0.9}


def _row_wise_processors() -> LogitsProcessorList:
    return LogitsProcessorList([TemperatureLogitsWarper(ROW_WISE_SAMPLING["temperature"]),
                                TopKLogitsWarper(ROW_WISE_SAMPLING["top_k"]),
                                TopPLogitsWarper(ROW_WISE_SAMPLING["top_p"])])


@pytest.mark.parametrize("method", sorted(EVERY_SHAPE))
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
                           speculation_config={**EVERY_SHAPE[method], "guard": False}, cache_implementation="static",
                           return_dict_in_generate=True).speculation_stats
    assert same.tokens_per_step == loop.tokens_per_step and same.target_forwards < n / 2, same.tokens_per_step


@pytest.mark.parametrize("method", sorted(EVERY_SHAPE))
def test_prompts_of_one_and_two_tokens_and_a_draft_the_target_disagrees_with(qwen2_pair, method):
    """The draft's first catch-up carries the prompt's last token (a one-token prompt: the draft reads nothing
    before the first step), and a draft whose tokens are mostly rejected keeps its cache in step: plain's output."""
    target, draft = qwen2_pair
    for length in (1, 2, 9):
        ids = random_prompt(torch.Generator().manual_seed(length), length)
        expected = target.generate(ids, do_sample=False, max_new_tokens=24, cache_implementation="static")
        out = captured_call(target, draft, ids, 24, method)
        assert torch.equal(out.sequences, expected), length


@pytest.mark.parametrize("method", sorted(EVERY_SHAPE))
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


#: processors a captured step gives every node's row at once: a penalty on each node's own ids, a row-wise one
PROCESSED = {"repetition_penalty": 1.8, "suppress_tokens": [5, 9]}


@pytest.mark.parametrize("method", sorted(EVERY_SHAPE))
def test_greedy_rows_are_processed_each_with_its_own_nodes_ids(qwen2_pair, method):
    """A repetition penalty reads each node's ids (the committed sequence, then the node's path below the root, in
    a fixed width: `logits/node_ids.py`), suppressed tokens a row alone: plain's tokens, which the processors change,
    with a draft that is the target (every step's deepest path kept: each node's row penalised by its own path) and
    one that is not; still one host read a step."""
    target, draft = qwen2_pair
    for seed in (3, 4):
        ids = random_prompt(torch.Generator().manual_seed(seed), 8)
        expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static", **PROCESSED)
        raw = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
        assert not torch.equal(expected, raw)
        with count_round_trips(target, draft) as counts:
            same = captured_call(target, copy.deepcopy(target), ids, 30, method, **PROCESSED)
        assert torch.equal(same.sequences, expected)
        assert all(step.reads == 1 for step in counts.steps), [(s.reads, s.draft_passes) for s in counts.steps]
        assert max(same.speculation_stats.tokens_per_step) > 2, same.speculation_stats.tokens_per_step
        assert torch.equal(captured_call(target, draft, ids, 30, method, **PROCESSED).sequences, expected)


@pytest.fixture
def plain_pattern(monkeypatch):
    """Captured schedules pick the root alone (a plain step) or their shape as `pattern[step % len]` says (True:
    plain); returns the list to fill."""
    pattern: list[bool] = []
    plain_steps_where(monkeypatch, lambda step: pattern[step % len(pattern)])
    return pattern


@pytest.mark.parametrize("method", sorted(EVERY_SHAPE))
def test_plain_steps_run_no_draft_pass_and_the_draft_catches_up_before_the_next_tree(qwen2_pair, method,
                                                                                   plain_pattern):
    """Plain steps (the root alone) among trees, one or several in a row, the first step plain too: plain's tokens;
    a plain step runs the target's pass alone and reads once; the first tree after them runs one eager catch-up pass
    over what the draft missed (one read more), and a draft that is the target still keeps the shape's whole depth
    there (a draft cache out of step with the sequence would propose other tokens)."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
    plain_pattern.append(False)
    fixed = captured_call(target, copy.deepcopy(target), ids, 30, method).speculation_stats  # the shape every step
    plain_pattern[:] = [True, False, True, True, False, False]
    passes, drafts = [], (copy.deepcopy(target), qwen2_pair[1])
    hook = target.register_forward_pre_hook(lambda *_: passes.append(1))
    for draft in drafts:
        passes.clear()
        with count_round_trips(target, draft) as counts:
            out = captured_call(target, draft, ids, 30, method)
        assert torch.equal(out.sequences, expected)
        stats = out.speculation_stats
        steps = len(stats.tokens_per_step)
        plain = [plain_pattern[i % len(plain_pattern)] for i in range(steps)]
        assert stats.plain_steps == sum(plain) > 2
        # the prompt's pass, then one a step but the first: plain, its token the prompt pass's (its row written)
        assert len(passes) == 1 + steps - 1 and stats.target_forwards == steps - 1
        assert [tokens for tokens, p in zip(stats.tokens_per_step, plain) if p] == [1] * sum(plain)
        for index, (step, is_plain) in enumerate(zip(counts.steps, plain)):
            after_plain = not is_plain and index > 0 and plain[index - 1]
            assert step.draft_passes == (0 if is_plain else fixed_passes(fixed) + after_plain), index
            assert step.reads == 1 + after_plain, index
        if draft is not qwen2_pair[1]:
            trees = [tokens for tokens, p in zip(stats.tokens_per_step, plain) if not p]
            assert all(tokens == max(fixed.tokens_per_step) for tokens in trees[:-1]), stats.tokens_per_step
    hook.remove()


def fixed_passes(stats) -> int:
    """Draft passes of one step of a call that drafted its shape every step."""
    return stats.draft_forwards // stats.target_forwards


def test_a_sized_schedule_that_prices_trees_a_loss_decodes_plainly_without_draft_passes(qwen2_pair, monkeypatch,
                                                                                          tmp_path):
    """`sequoia` at its defaults, captured, with curves where a draft pass costs what the target's does: the cost model
    picks the root alone (plain steps, no draft pass), trees only as its probes; plain's tokens. (The plan this
    unrelated draft calibrates is stored apart: other tests' calls find the suite's store as they left it.)"""
    import dataclasses

    from hf_specdec.methods import static_shape
    from hf_specdec.methods.sequoia import store
    from hf_specdec.plan.latency import LatencyCurve

    monkeypatch.setattr(store, "user_plan_dir", lambda: tmp_path)

    measured = static_shape.online_sizer

    def costly_draft(profile, target, draft, processors):
        sizer = measured(profile, target, draft, processors)
        flat = LatencyCurve((1, 128), (0.01, 0.01))
        sizer.profile = dataclasses.replace(profile, target=flat, draft=flat, step_overhead=0.0)
        sizer.timing_memory = 1.0
        return sizer

    monkeypatch.setattr(static_shape, "online_sizer", costly_draft)
    target, draft = qwen2_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
    out = target.generate(ids, assistant_model=draft, speculation="sequoia", do_sample=False, max_new_tokens=30,
                          speculation_config={"captured": True, "guard": False}, cache_implementation="static",
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = out.speculation_stats
    trees = len(stats.tokens_per_step) - stats.plain_steps
    assert stats.plain_steps >= 24 and trees <= 3, stats.tokens_per_step  # a probe after every 8 plain choices
    assert stats.draft_forwards <= trees * 7  # each tree's levels and catch-up; plain steps none


@pytest.mark.parametrize("method", sorted(EVERY_SHAPE))
def test_the_guard_turns_captured_steps_plain_while_speculation_loses(qwen2_pair, method, monkeypatch):
    """The measured guard (on by default) in a captured call: one that judges every speculative step a loss waits
    plain steps (no draft pass, one read), then probes with a tree after the draft caught up; plain's tokens. The
    suite's guard, which never judges a loss, leaves every step speculating."""
    import weakref

    from hf_specdec.draft import guarded
    from hf_specdec.plan import guard
    from hf_specdec.plan.guard import PlainGuard

    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
    call = dict(assistant_model=copy.deepcopy(target), speculation=method, do_sample=False, max_new_tokens=30,
                speculation_config={**EVERY_SHAPE[method], "captured": True}, cache_implementation="static",
                return_dict_in_generate=True)
    kept = target.generate(ids, **call)
    assert torch.equal(kept.sequences, expected) and kept.speculation_stats.plain_steps == 0
    monkeypatch.setattr(guard, "_REMEMBERED", weakref.WeakKeyDictionary())  # not the guard the last call left
    monkeypatch.setattr(guarded, "sequence_guard", lambda: PlainGuard(margin=0.0, patience=2, quick_patience=1))
    with count_round_trips(target, call["assistant_model"]) as counts:
        out = target.generate(ids, **call)
    assert torch.equal(out.sequences, expected)
    stats = out.speculation_stats
    plain = [tokens == 1 and step.draft_passes == 0 for tokens, step in zip(stats.tokens_per_step, counts.steps)]
    assert stats.plain_steps == sum(plain) >= 4, stats.tokens_per_step  # a wait of 4 plain steps (then 8, ...)
    assert any(prev and not now for prev, now in zip(plain, plain[1:])), stats.tokens_per_step  # then a probe
    assert max(stats.tokens_per_step) > 2 and stats.target_forwards < 30  # trees still drafted (and kept)
    assert all(step.reads == 1 for step, is_plain in zip(counts.steps, plain) if is_plain)


def _with_compile_step(loop, compiler, *args, **kwargs):
    return loop(*args, **{**kwargs, "compile_step": compiler})


def test_the_guard_does_not_judge_a_compiled_functions_first_runs(qwen2_pair, monkeypatch):
    """Where the step is compiled, the first `WARM_RUNS` runs of each function (compiling, recording a CUDA graph)
    are not judged by the guard: their time is not the step's. Eagerly every step is."""
    from hf_specdec.plan.guard import PlainGuard

    judged = []
    observe = PlainGuard.observe
    monkeypatch.setattr(PlainGuard, "observe", lambda self, *args, **kwargs: judged.append(args) or observe(
        self, *args, **kwargs))
    loop = captured.captured_loop
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    for compile_step in (None, lambda step: step):  # the second stands for a compiler: the loop cannot tell
        monkeypatch.setattr("hf_specdec.integration.generate.captured_loop",
                            functools.partial(_with_compile_step, loop, compile_step))
        judged.clear()
        out = target.generate(ids, assistant_model=copy.deepcopy(target), speculation="chain", do_sample=False,
                              max_new_tokens=30, speculation_config={**SHAPES["chain"], "captured": True},
                              cache_implementation="static", return_dict_in_generate=True)
        steps = out.speculation_stats.target_forwards
        assert len(judged) == (steps if compile_step is None else steps - captured.WARM_RUNS) > 0


@pytest.mark.parametrize("pattern", [[True, True], [True, False]], ids=["plain-plain", "plain-tree"])
def test_plain_steps_sample_exactly_plain_samplings_distribution(pattern, plain_pattern):
    """Two sampled tokens, the first from a plain step, the second from another or from a tree drafted after the
    draft caught up: plain sampling's exact joint law (chi-square and total variation), as for trees alone."""
    plain_pattern += pattern
    target, draft = sampling_pair()
    exact = joint_of(target, PROMPT, _row_wise_processors())
    torch.manual_seed(4321)
    counts, plain_steps = Counter(), 0
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, assistant_model=draft, speculation="sequoia", max_new_tokens=2,
                              speculation_config={**SHAPES["sequoia"], "captured": True, "guard": False},
                              cache_implementation="static", return_dict_in_generate=True, **ROW_WISE_SAMPLING)
        counts[tuple(out.sequences[0, PROMPT.shape[1]:].tolist())] += 1
        plain_steps += out.speculation_stats.plain_steps
    assert plain_steps == SAMPLES * sum(pattern)
    assert chi_square_pvalue(counts, exact, SAMPLES) > 1e-3
    assert total_variation({k: c / SAMPLES for k, c in counts.items()}, exact) < 0.2


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
def test_the_step_compiled_whole_gives_the_same_tokens(qwen2_pair, monkeypatch, plain_pattern):
    """`torch.compile` over the whole step as one graph (`fullgraph=True` raises at any break; inductor on the CPU
    here, where a GPU call compiles it with the call's compile config, mode="reduce-overhead" by default): plain's
    tokens, every step run by the compiled function; sampled steps too, and plain steps (the root alone) among trees,
    a graph of their own."""
    plain_pattern.append(False)
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
    # a repetition penalty on every node's fixed-width ids, and the sequence's buffer it reads, in the same graph
    calls.clear()
    torch._dynamo.reset()
    penalised = target.generate(ids, do_sample=False, max_new_tokens=20, cache_implementation="static", **PROCESSED)
    out = captured_call(target, copy.deepcopy(target), ids, 20, "tree", **PROCESSED)
    assert torch.equal(out.sequences, penalised) and len(calls) == out.speculation_stats.target_forwards
    # sampled: the draws, the processors and the walk compile into the same one graph; the target as its draft keeps
    # the whole depth each step, as eagerly (inductor draws from its own random stream: not the eager tokens)
    calls.clear()
    torch._dynamo.reset()
    out = captured_call(target, copy.deepcopy(target), ids, 20, "tree", do_sample=True, temperature=0.9, top_k=20)
    steps = out.speculation_stats.tokens_per_step
    assert out.sequences.shape[1] == ids.shape[1] + 20 and len(calls) == len(steps)
    assert all(tokens == 3 for tokens in steps[:-1]), steps
    calls.clear()
    torch._dynamo.reset()
    plain_pattern[:] = [True, False, True]
    out = captured_call(target, copy.deepcopy(target), ids, 20, "tree")
    assert torch.equal(out.sequences, expected)
    assert len(calls) == out.speculation_stats.target_forwards and out.speculation_stats.plain_steps > 2
    assert out.speculation_stats.graphs_compiled == 2
    # a tree grown best first: its frontiers' top-k, the ancestor matrix and the chosen nodes compile into the graph
    calls.clear()
    torch._dynamo.reset()
    plain_pattern[:] = [False]
    out = captured_call(target, copy.deepcopy(target), ids, 20, "specexec")
    assert torch.equal(out.sequences, expected) and len(calls) == out.speculation_stats.target_forwards
    # ... and sampled: the processed draft rows, the draws at every node and the walk, in the same one graph
    calls.clear()
    torch._dynamo.reset()
    out = captured_call(target, copy.deepcopy(target), ids, 20, "specexec", do_sample=True, temperature=0.9, top_k=8)
    steps = out.speculation_stats.tokens_per_step
    assert out.sequences.shape[1] == ids.shape[1] + 20 and len(calls) == len(steps)
    assert all(tokens >= 2 for tokens in steps[:-1]), steps


@pytest.mark.parametrize("method", [*sorted(EVERY_SHAPE), "sequoia sized", "specexec sized"])
def test_sampled_steps_sample_exactly_plain_samplings_distribution(method):
    """Two sampled tokens over an 8-token vocabulary (both from the first step when its drafts are accepted): their
    joint frequencies against the exact distribution plain sampling has (temperature, top-k, top-p, computed prefix
    by prefix), by a chi-square test and the total variation; and steps did accept drafted tokens. Fixed shapes, a
    tree grown best first (verified by target sampling), and `sequoia` and `specexec` at their defaults (a bucketed
    shape or budget chosen every step from the verdicts before it)."""
    _samples_exactly(method, ROW_WISE_SAMPLING, _row_wise_processors())


@pytest.mark.parametrize("method", ["sequoia", "specexec", "sequoia sized"])
def test_sampled_steps_with_a_repetition_penalty_sample_exactly(method):
    """The same, with a repetition penalty (and temperature and top-p, `tests.helpers.sampling.SAMPLING`): the
    target's rows penalised by each node's own ids, the prompt's repeated tokens and the first token's (the second
    token is drawn below a drafted first one); the draft's rows take the row-wise processors only."""
    _samples_exactly(method, SAMPLING, None)


def _samples_exactly(method: str, sampling: dict, processors: LogitsProcessorList | None) -> None:
    target, draft = sampling_pair()
    exact = joint_of(target, PROMPT, processors)
    torch.manual_seed(1234)
    counts, accepted_drafts = Counter(), 0
    name, settings = method.split()[0], {} if method.endswith("sized") else EVERY_SHAPE[method]
    for _ in range(SAMPLES):
        out = target.generate(PROMPT, assistant_model=draft, speculation=name, max_new_tokens=2,
                              speculation_config={**settings, "captured": True, "guard": False},
                              cache_implementation="static", return_dict_in_generate=True, **sampling)
        counts[tuple(out.sequences[0, PROMPT.shape[1]:].tolist())] += 1
        accepted_drafts += out.speculation_stats.target_forwards == 1
    assert chi_square_pvalue(counts, exact, SAMPLES) > 1e-3
    assert total_variation({k: c / SAMPLES for k, c in counts.items()}, exact) < 0.2
    assert accepted_drafts > SAMPLES // 10
    assert max(max(k) for k in counts) < VOCAB


@pytest.mark.parametrize("method", sorted(SHAPES))
def test_a_sampled_step_with_the_target_as_its_draft_keeps_the_whole_depth_and_reads_once(qwen2_pair, method):
    """A draft that is the target proposes from the target's own rows, so the walk accepts the first drawn child at
    every level (p / q = 1): each step keeps the shape's deepest path, which only holds when every node's kept row is
    the one its children were drawn from. One host read a step; a seed reproduces the call."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    depth = {"chain": 4, "tree": 2, "sequoia": None}[method]
    with count_round_trips(target, qwen2_pair[1]) as counts:
        torch.manual_seed(7)
        out = captured_call(target, copy.deepcopy(target), ids, 30, method, do_sample=True, temperature=0.9, top_k=20)
    stats = out.speculation_stats
    full = stats.tokens_per_step[0]
    assert full > 2 and (depth is None or full == depth + 1)
    assert all(tokens == full for tokens in stats.tokens_per_step[:-1]), stats.tokens_per_step
    assert all(step.reads == 1 for step in counts.steps), [(s.reads, s.draft_passes) for s in counts.steps]
    torch.manual_seed(7)
    again = captured_call(target, copy.deepcopy(target), ids, 30, method, do_sample=True, temperature=0.9, top_k=20)
    assert torch.equal(again.sequences, out.sequences)


@pytest.mark.parametrize("method", ["sequoia", "tree", "chain"])
def test_shapes_sized_every_step_are_captured_from_a_few_buckets(qwen2_pair, method):
    """`sequoia` and `chain` at their defaults (the DP's trees, or chain lengths, sized every step) and `tree` with
    `per_step`: each step drafts one of
    a few shapes (one per size bucket, `shape_sizing.CAPTURED_SIZES`, or the root alone) chosen by the cost model;
    plain's tokens with a draft that is the target and one that is not, and the shapes the steps met (their padded
    target passes) only the buckets'; with the target as its draft, the sizing learns to draft trees."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30, cache_implementation="static")
    settings = {"captured": True, "guard": False, **({"widths": [3, 2, 2]} if method == "tree" else {})}
    calls = []
    for draft in (copy.deepcopy(target), qwen2_pair[1]):  # the first calibrates sequoia's plan: a sure draft's
        out = target.generate(ids, assistant_model=draft, speculation=method, do_sample=False, max_new_tokens=30,
                              speculation_config=settings, cache_implementation="static", return_dict_in_generate=True)
        calls.append(out.speculation_stats)
        assert torch.equal(out.sequences, expected)
        assert calls[-1].captured and calls[-1].tree_pass_sizes <= {1, *CAPTURED_SIZES}, calls[-1].tree_pass_sizes
    steps = calls[0].tokens_per_step
    assert max(steps) > 3 and calls[0].plain_steps < len(steps) / 2, steps


def test_a_generator_is_honoured_eagerly_and_refused_where_the_step_compiles(qwen2_pair):
    """`speculation_generator` drives a sampled captured step's draws where it runs eagerly (the same seed, the same
    tokens; another seed, others); a compiled step cannot draw from a `torch.Generator` (Dynamo breaks the graph
    there), so a call that compiles (here `_compile_all_devices` on the CPU) is refused before decoding."""
    target, draft = qwen2_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 8)

    def sampled(seed, **kwargs):
        return captured_call(target, draft, ids, 16, "tree", do_sample=True, top_k=20,
                             speculation_generator=torch.Generator().manual_seed(seed), **kwargs).sequences

    assert torch.equal(sampled(3), sampled(3)) and not torch.equal(sampled(3), sampled(4))
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    with pytest.raises(ValueError, match="speculation_generator is given"):
        sampled(3, compile_config=config)


REFUSED = [
    ({"do_sample": True}, {"verifier": "specinfer"}, "verifier='specinfer'"),
    ({"do_sample": True, "bad_words_ids": [[3, 4]]}, {}, "read the ids' order or count are on (NoBadWords"),
    ({"cache_implementation": "dynamic"}, {}, "cache_implementation='static'"),
    ({"no_repeat_ngram_size": 2, "repetition_penalty": 1.2}, {}, "are on (NoRepeatNGramLogitsProcessor)"),
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


def test_a_sampled_grown_tree_with_the_target_as_its_draft_keeps_a_token_every_step_and_reads_once(qwen2_pair):
    """`specexec` captured, sampled: the tree grows by the draft's processed rows and is verified by target sampling.
    With the target as its draft and top_k equal to the width, the root's children are the whole support of the
    target's processed row, so every step's draw at the root lands on a child: each step keeps at least 2 tokens.
    One host read a step, whatever the draft passes; a seed reproduces the call."""
    target = qwen2_pair[0]
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    sampling = {"do_sample": True, "temperature": 0.9, "top_k": 8}  # the default width: 8 children a node
    with count_round_trips(target, qwen2_pair[1]) as counts:
        torch.manual_seed(7)
        out = captured_call(target, copy.deepcopy(target), ids, 30, "specexec", **sampling)
    steps = out.speculation_stats.tokens_per_step
    assert out.sequences.shape[1] == ids.shape[1] + 30 and out.speculation_stats.captured
    assert all(tokens >= 2 for tokens in steps[:-1]) and max(steps) > 2, steps
    assert all(step.reads == 1 and step.draft_passes >= 2 for step in counts.steps)
    torch.manual_seed(7)
    again = captured_call(target, copy.deepcopy(target), ids, 30, "specexec", **sampling)
    assert torch.equal(again.sequences, out.sequences)


def test_staged_has_no_captured_setting(qwen2_pair):
    """`staged`'s lower stages draft on the host: it has no `captured` setting, and saying it is refused."""
    target, draft = qwen2_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    with pytest.raises(ValueError, match="has no setting"):
        target.generate(ids, assistant_model=draft, speculation="staged", do_sample=False, max_new_tokens=8,
                        cache_implementation="static", speculation_config={"budget": 16, "captured": True})


def test_specexec_sized_every_step_grows_one_of_a_few_budgets(qwen2_pair, monkeypatch):
    """`specexec` at its defaults, captured: each step grows one of the budgets of `CAPTURED_SIZES` (its target pass
    one of their padded sizes), chosen from the tree the step before grew; plain's tokens with a draft that is the
    target and one that is not, one read a step. With a sure draft (a sharpened target as its own draft) and a cheap
    one (curves as the suite's `tree_sizing_sees_a_cheap_draft` states them), the schedule moves between budgets and
    its trees keep several tokens a step."""
    import dataclasses

    from hf_specdec.methods import step_sized
    from hf_specdec.plan.latency import LatencyCurve
    from tests.tiny import tiny_model

    measured = step_sized.online_sizer

    def cheap_draft(profile, target, draft, processors):
        sizer = measured(profile, target, draft, processors)
        flat = lambda seconds: LatencyCurve((1, 128), (seconds, seconds))  # noqa: E731
        sizer.profile = dataclasses.replace(profile, target=flat(0.01), draft=flat(0.0002), step_overhead=0.0)
        return sizer

    monkeypatch.setattr(step_sized, "online_sizer", cheap_draft)
    sure = tiny_model("qwen2", 0, sharpen=20.0)  # its top token 0.69 on the test's prompt
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    for target, draft in ((qwen2_pair[0], qwen2_pair[1]), (sure, copy.deepcopy(sure))):
        expected = target.generate(ids, do_sample=False, max_new_tokens=40, cache_implementation="static")
        with count_round_trips(target, draft) as counts:
            out = target.generate(ids, assistant_model=draft, speculation="specexec", do_sample=False,
                                  max_new_tokens=40, speculation_config={"captured": True, "guard": False},
                                  cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        stats = out.speculation_stats
        assert stats.captured and stats.tree_pass_sizes <= {1, *CAPTURED_SIZES}, stats.tree_pass_sizes
        assert all(step.reads == 1 for step in counts.steps)
    assert len(stats.tree_pass_sizes) >= 2 and stats.shrunk_steps > 0, stats.tree_pass_sizes
    assert sum(stats.tokens_per_step) / len(stats.tokens_per_step) > 3, stats.tokens_per_step


def test_the_growth_schedule_prices_budgets_from_the_tree_before():
    """`GrowthSchedule`: the middle budget first; after a tree of sure tokens (a chain the draft gives 0.999 each)
    on a flat target curve and a cheap draft, a larger budget; after a tree of unsure ones (0.01 each), the smallest;
    each verdict teaches the acceptance curve (the children of reached nodes)."""
    import math

    from hf_specdec.methods.specexec.captured_growth import LOGQ_UNIT, GrowthSchedule
    from hf_specdec.plan.latency import LatencyCurve
    from hf_specdec.plan.sizing import HardwareProfile
    from hf_specdec.plan.step_sizing import OnlineAcceptance, StepSizer

    profile = HardwareProfile(LatencyCurve((1, 64), (0.05, 0.05)), LatencyCurve((1, 64), (0.002, 0.002)))
    schedule = GrowthSchedule(StepSizer(profile, OnlineAcceptance()), width=8, max_depth=12, max_budget=2048)
    assert [spec.nodes for spec in schedule.menu] == list(CAPTURED_SIZES)
    first = schedule.next()
    assert first.nodes == 16
    chain = [0, *range(15)]  # node i's parent is i - 1
    sure = [round(math.log(0.999) / LOGQ_UNIT)] * 16
    schedule.learn(first, chain + sure, path=list(range(16)))
    assert schedule.sizer.acceptance.observations == 15
    assert schedule.next().nodes > 16
    bushy = [0] * 16  # every node a child of the root
    unsure = [round(math.log(0.01) / LOGQ_UNIT)] * 16
    schedule.learn(first, bushy + unsure, path=[0])
    assert schedule.next().nodes == CAPTURED_SIZES[0]


def test_a_grown_shape_loses_passes_and_nodes_where_the_rows_run_out():
    """`GrowthSpec.within`: the budget's shape whole where it fits; fewer passes where the draft's rows or the
    position table run out, fewer nodes (a power of two) where the target's rows do, the root alone where no child
    fits."""
    from hf_specdec.methods.specexec.captured_growth import GrowthSpec

    spec = GrowthSpec.of(16, width=8, beams=None, max_depth=12)
    assert (spec.nodes, spec.beams, spec.passes, spec.depth, spec.draft_passes) == (16, 4, 4, 5, 5)
    assert spec.within(16, 16, None) == spec
    assert spec.within(16, 9, None).passes == 2
    assert spec.within(16, 16, 3) == GrowthSpec(16, 4, 8, 2, 3)
    assert spec.within(9, 16, None).nodes == 8 and spec.within(9, 16, None).size <= 9
    assert spec.within(16, 0, None) == GrowthSpec(9, 4, 8, 0, 12)  # the root's children only: no pass after
    assert spec.within(1, 16, None) is None and spec.within(16, 16, 0) is None
    assert GrowthSpec.of(4, width=8, beams=None, max_depth=12).passes == 1


def test_trees_sized_by_the_drafts_probabilities_and_a_batch_are_refused(qwen2_pair):
    target, draft = qwen2_pair
    ids = random_prompt(torch.Generator().manual_seed(5), 8)
    with pytest.raises(ValueError, match="sized by the draft's own probabilities"):  # a chain stopped when unsure
        target.generate(ids, assistant_model=draft, speculation="chain", do_sample=False, max_new_tokens=8,
                        cache_implementation="static",
                        speculation_config={"captured": True, "guard": False, "per_step": False})
    with pytest.raises(ValueError, match="a batch of 2"):
        target.generate(ids.repeat(2, 1), assistant_model=draft, speculation="tree", do_sample=False,
                        max_new_tokens=8, speculation_config={**SHAPES["tree"], "captured": True, "guard": False})
    with pytest.raises(ValueError, match="captured must be True or False"):
        target.generate(ids, assistant_model=draft, speculation="tree", speculation_config={"captured": "yes"})
