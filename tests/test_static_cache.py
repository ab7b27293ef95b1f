"""Speculation on a static KV cache (`cache_implementation="static"`, a `StaticCache` passed in) and with a compiled
target forward: greedy token-identical to plain static-cache `generate`, sampling exact, fixed tree-pass shapes, the
cache compacted in place, clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import CompileConfig, DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from hf_specdec.accept.kv_cache import cache_length, crop, full_length_cache, keep_positions, layer_rows
from hf_specdec.core.releases import cache_arg, output_cache
from hf_specdec.core.tree import TokenTree
from hf_specdec.decoding.step import tree_pass
from hf_specdec.runtime.attention import AttentionLayout
from hf_specdec.runtime.pass_shapes import PassShapes, fit_tree, padded_inputs, padded_pass
from hf_specdec.verify import SequoiaVerifier, TargetSampleVerifier
from tests.conftest import random_prompt, tiny_model
from tests.families import WINDOW, family
from tests.helpers.exactness import speculative_joint, target_joint, total_variation
from tests.helpers.family_cases import METHODS, ModelCase, new_tokens, prompt, tiny
from tests.helpers.faults import FAULTS, Boom, _interrupt_in_layer
from tests.helpers.plain_steps import guard_plain_at
from tests.roundtrips import count_round_trips

# Plain full attention, one sliding-window mask, full + sliding layers (a dict of masks), a learned position table.
FAMILIES = ["Llama", "Mistral (sliding window)", "Gemma 3 (text)", "GPT-2"]
ALL_METHODS = {"chain": {"confidence_threshold": 0}, **METHODS}  # a fixed chain: its passes padded to fixed sizes


def plain_static(target, ids, n, **kwargs):
    return target.generate(ids, do_sample=False, max_new_tokens=n, cache_implementation="static", **kwargs)


def speculate(target, ids, n, method, **kwargs):
    return target.generate(ids, assistant_model=copy.deepcopy(target), speculation=method,
                           speculation_config=ALL_METHODS[method], do_sample=False, max_new_tokens=n,
                           return_dict_in_generate=True, **kwargs)


PROMPT_ROWS = 20  # a draft static cache just too small for the runner test's second step


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("name", FAMILIES)
def test_identical_to_plain_static_generate(name, method):
    target = tiny(name)
    ids, n = prompt(), new_tokens(family(name))
    expected = plain_static(target, ids, n)
    out = speculate(target, ids, n, method, cache_implementation="static")
    assert torch.equal(out.sequences, expected)
    stats = out.speculation_stats
    assert stats.target_forwards / n <= 0.5 or method == "staged", stats.tokens_per_step  # it really speculates
    # fixed shapes: every pass a power-of-two bucket, so a compiled forward makes at most log2(cache rows) + 1 graphs
    assert stats.tree_pass_sizes and all(is_power_of_two(size) for size in stats.tree_pass_sizes)
    # the draft on a static cache of its own, its passes padded alike
    assert stats.draft_pass_sizes and all(is_power_of_two(size) for size in stats.draft_pass_sizes)
    assert isinstance(output_cache(out), StaticCache)
    assert all(isinstance(layer, StaticLayer) and not layer.is_sliding for layer in output_cache(out).layers)
    assert cache_length(output_cache(out)) == expected.shape[1] - 1


@pytest.mark.parametrize("name", FAMILIES)
def test_a_plain_first_step_on_a_static_cache_runs_no_target_pass(name, monkeypatch):
    """The loop's plain first step takes its token from the prompt's pass, whose row the static cache keeps (only
    its write length moves): no target pass, plain static generate's tokens, the cache left as plain leaves it."""
    guard_plain_at(monkeypatch, (0, 3, 4))
    target = tiny(name)
    ids, n = prompt(), new_tokens(family(name))
    out = target.generate(ids, assistant_model=copy.deepcopy(target), speculation="chain", do_sample=False,
                          speculation_config={"num_draft_tokens": 3, "confidence_threshold": 0}, max_new_tokens=n,
                          cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain_static(target, ids, n))
    stats = out.speculation_stats
    assert stats.tokens_per_step[0] == 1 and stats.plain_steps == 3
    assert stats.target_forwards == len(stats.tokens_per_step) - 1
    assert cache_length(output_cache(out)) == out.sequences.shape[1] - 1


@pytest.mark.parametrize("method", ["chain", "tree", "sequoia"])
@pytest.mark.parametrize("name", ["Llama", "Gemma 3 (text)"])
def test_a_fixed_shapes_draft_levels_build_their_inputs_on_the_device_once_per_level(name, method, monkeypatch):
    """A fixed shape's draft levels on a static cache: each level's rows are made once per call
    (`PaddedTree.level`) and its passes build their positions and masks from them on the device (the host builds
    only the catch-up passes); output plain's, sliding windows (Gemma 3) included."""
    from hf_specdec.draft import draft_model
    from hf_specdec.runtime import pass_shapes

    made, host_built = [], []
    level = pass_shapes.PaddedTree.level
    monkeypatch.setattr(pass_shapes.PaddedTree, "level", classmethod(
        lambda cls, *args: made.append((args[0].tolist(), args[2].tolist())) or level(*args)))
    host = draft_model.padded_inputs
    monkeypatch.setattr(draft_model, "padded_inputs", lambda *args: host_built.append(1) or host(*args))
    target = tiny(name)
    ids, n = prompt(), new_tokens(family(name))
    out = speculate(target, ids, n, method, cache_implementation="static")
    assert torch.equal(out.sequences, plain_static(target, ids, n))
    stats = out.speculation_stats
    level_passes = stats.draft_forwards - stats.target_forwards  # one catch-up (the root's logits) a step
    assert stats.target_forwards >= 2 and made and level_passes > len(made)  # made once, used in every step
    assert len({str(level) for level in made}) == len(made)  # (depths, earlier rows' depths): each level once
    assert not host_built  # the catch-ups run unpadded here (no node joins them)


@pytest.mark.parametrize("name", ["Llama", "Gemma 3 (text)"])
def test_static_cache_passed_in_is_the_one_filled(name):
    """A StaticCache the user passes stays their object: its sliding layers become full-length ones in place, and it
    ends holding the sequence but its last token, as plain's does; with room to spare the tree keeps one size."""
    target = tiny(name)
    ids, n = prompt(), 30
    expected = plain_static(target, ids, n)
    config = target.config.get_text_config(decoder=True)
    cache = StaticCache(config=config, max_cache_len=ids.shape[1] + n + 64)
    out = speculate(target, ids, n, "sequoia", **cache_arg(cache))
    assert torch.equal(out.sequences, expected)
    assert output_cache(out) is cache and cache_length(cache) == expected.shape[1] - 1
    assert out.speculation_stats.tree_pass_sizes == {16}  # the 16-node plan, never cut: one graph


@pytest.mark.parametrize("name", FAMILIES[:3])
def test_draft_runner_on_a_static_cache_matches_the_dynamic_one(name):
    """The draft's static cache (padded passes, compaction in place, an eager catch-up of a long run of new tokens,
    a cache that grows when a step needs more rows) gives the logits its dynamic cache gives."""
    from hf_specdec.draft.draft_model import EAGER_CATCH_UP, DraftModelRunner

    draft = tiny(name)
    dynamic, static = DraftModelRunner(draft), DraftModelRunner(draft)
    static.use_static_cache(PROMPT_ROWS, lambda model, cache: None)
    ids = prompt()[0].tolist()
    level1, level2 = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    sees1 = torch.eye(3, dtype=torch.bool)
    sees2 = torch.tensor([[True, False, False, True, False], [False, True, False, False, True]])
    for step in range(2):
        outs = []
        for runner in (dynamic, static):
            root, first = runner.forward_tree(level1, torch.ones(3, dtype=torch.long), sees1, ids)
            _, second = runner.forward_tree(level2, torch.full((2,), 2), sees2)
            outs.append((root, first, second))
            runner.commit(ids + [6, 9], [1, 4])  # the path root -> 6 -> 9
        for got, want in zip(outs[1], outs[0]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        ids = ids + [6, 9] + list(range(10, 11 + EAGER_CATCH_UP + 2 * step))  # more than a padded pass takes
    assert static.shapes.width > PROMPT_ROWS  # the second step needed more rows than given: the cache grew
    assert all(is_power_of_two(size) for size in static.shapes.sizes)
    assert cache_length(static.cache) == cache_length(dynamic.cache) == len(static.committed)


def test_static_compaction_writes_the_path_rows_in_place():
    """Compaction copies at most depth + 1 rows into the preallocated buffers and resets the device-side length."""
    layer = StaticLayer(max_cache_len=12)
    cache = StaticCache.__new__(StaticCache)
    cache.layers = [layer]
    rows = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 2, 8, 3).contiguous()
    layer.update(rows, rows + 100)
    keys, values = layer.keys.data_ptr(), layer.values.data_ptr()
    keep_positions(cache, 3, [3, 5, 7])
    assert layer.keys.data_ptr() == keys and layer.values.data_ptr() == values  # same buffers: compiled graphs hold
    assert layer.keys.shape[-2] == 12 and int(layer.cumulative_length) == 6
    assert layer.keys[0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 7]
    assert layer.values[0, 1, :6, 2].tolist() == [100, 101, 102, 103, 105, 107]
    layer.update(rows[:, :, :1] + 50, rows[:, :, :1])  # the next write lands right after the kept path
    assert layer.keys[0, 0, 6, 0] == 50 and int(layer.cumulative_length) == 7


def test_static_sliding_layer_that_wrapped_is_refused():
    target = tiny("Mistral (sliding window)")
    cache = StaticCache(config=target.config, max_cache_len=64)
    with torch.no_grad():
        target(prompt(2 * WINDOW), **cache_arg(cache), use_cache=True)  # fills past the window: rows dropped
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match="sliding-window layers that already dropped"):
        speculate(target, prompt(2 * WINDOW), 8, "chain", **cache_arg(cache))
    assert all(torch.equal(layer.keys, old) for layer, old in zip(cache.layers, before))  # left as it was


def test_trees_lose_whole_levels_to_fit_the_cache():
    tree = TokenTree.from_parents(list(range(7)), [-1, 0, 0, 1, 1, 2, 3])  # levels of 1, 2, 3, 1 nodes
    assert fit_tree(tree, 10, None, 7) == (tree, None)
    cut, kept = fit_tree(tree, 10, None, 4)
    assert kept == [0, 1, 2] and cut.host().parents == [-1, 0, 0]
    assert fit_tree(tree, 10, 1, 16)[1] == [0, 1, 2]  # a learned position table's limit, too
    shapes = PassShapes(width=20)
    assert [shapes.rows(past) for past in (0, 4, 12, 19, 20)] == [16, 16, 8, 1, 0]
    assert [shapes.size(n) for n in (1, 5, 8, 9)] == [1, 8, 8, 16] and shapes.sizes == {1, 8, 16}
    with pytest.raises(ValueError, match="static cache is full"):
        fit_tree(tree, 20, None, 0)


LAYOUTS = [AttentionLayout(("full_attention",)), AttentionLayout(("sliding_attention",), window=3),
           AttentionLayout(("full_attention", "sliding_attention"), window=4)]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_padded_pass_built_on_the_device_equals_the_host_built_one(data):
    """The target's padded pass takes positions and masks built on the device from its shape and the past length
    (a host number or a device scalar, as a static layer's write length is): the same as those the host builds
    (`padded_inputs`), for any tree, past, padding and sliding window."""
    n = data.draw(st.integers(1, 12))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tree = TokenTree.from_parents([5 + i for i in range(n)], parents)
    shapes = PassShapes(width=data.draw(st.integers(16, 40)))
    past = data.draw(st.integers(0, shapes.width - 16))
    layout, dtype = data.draw(st.sampled_from(LAYOUTS)), torch.float32
    size = shapes.size(n)
    host = tree.host()
    expected = padded_inputs(tree.input_tokens, host.structure()[0] + past, host.visibility(past),
                             torch.cat([torch.arange(past), host.structure()[0] + past]), size, shapes.width,
                             layout, dtype, torch.device("cpu"))
    built = padded_pass(tree, past, shapes, layout, dtype, torch.device("cpu"))
    assert torch.equal(built.tokens, expected.tokens) and torch.equal(built.positions, expected.positions)
    masks = [built.masks, expected.masks]
    masks += [shapes.padded_tree(tree, size, torch.device("cpu")).inputs(torch.tensor(past), shapes.width, layout,
                                                                         dtype)[1]]
    as_dicts = [m if isinstance(m, dict) else {"one": m} for m in masks]
    assert all(as_dicts[0].keys() == d.keys() and all(torch.equal(d[k], as_dicts[0][k]) for k in d)
               for d in as_dicts[1:])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_draft_levels_padded_pass_built_on_the_device_equals_the_host_built_one(data):
    """A draft's pass over a level of nodes after `past` committed tokens and `old` node rows forwarded before it
    (each node seeing some of them, some of its own level, and itself), built on the device from the level
    (`PaddedTree.level`, past a host number or a device scalar): the same positions and masks as the host's
    (`padded_inputs` with the runner's visibility and key positions), for any level, padding and sliding window."""
    old, k = data.draw(st.integers(0, 6)), data.draw(st.integers(1, 8))
    earlier = torch.tensor([data.draw(st.integers(1, 4)) for _ in range(old)], dtype=torch.long)
    depths = torch.tensor([data.draw(st.integers(1, 5)) for _ in range(k)], dtype=torch.long)
    sees = torch.tensor([[data.draw(st.booleans()) for _ in range(old + k)] for _ in range(k)])
    shapes = PassShapes(width=data.draw(st.integers(old + 17, 48)))
    past = data.draw(st.integers(1, shapes.width - old - 16))
    layout, dtype, cpu = data.draw(st.sampled_from(LAYOUTS)), torch.float32, torch.device("cpu")
    size = shapes.size(k)
    positions = past - 1 + depths
    allowed = torch.cat([torch.ones(k, past, dtype=torch.bool), sees[:, :old],
                         sees[:, old:] | torch.eye(k, dtype=torch.bool)], dim=1)
    keys = torch.cat([torch.arange(past), past - 1 + earlier, positions])
    tokens = torch.arange(7, 7 + k)
    expected = padded_inputs(tokens, positions, allowed, keys, size, shapes.width, layout, dtype, cpu)
    level = shapes.padded_level("a level", depths, sees, earlier, size, cpu)
    assert shapes.padded_level("a level", depths, sees, earlier, size, cpu) is level  # kept for the call
    for at in (past, torch.tensor(past)):
        built, masks = level.inputs(at, shapes.width, layout, dtype, origin=at - 1)
        assert torch.equal(built, expected.positions[0])
        as_dicts = [m if isinstance(m, dict) else {"one": m} for m in (masks, expected.masks)]
        assert as_dicts[0].keys() == as_dicts[1].keys()
        assert all(torch.equal(as_dicts[0][key], as_dicts[1][key]) for key in as_dicts[0])


def test_a_padded_pass_that_does_not_fit_the_cache_is_refused():
    tree = TokenTree.from_parents([5, 6, 7], [-1, 0, 1])
    with pytest.raises(ValueError, match="does not fit 20 cache rows after 17"):
        padded_pass(tree, 17, PassShapes(width=20), LAYOUTS[0], torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("method", ["sequoia", "specexec"])
def test_static_steps_read_the_device_no_more_than_dynamic_ones(method):
    """Padding, cache-wide masks and in-place compaction add no host reads: at most draft passes + 2 per step."""
    target, draft = tiny("Qwen2"), tiny("Qwen2", 1)
    ids = prompt()
    with count_round_trips(target, draft) as counts:
        target.generate(ids, assistant_model=draft, speculation=method, speculation_config=ALL_METHODS[method],
                        max_new_tokens=30, do_sample=False, cache_implementation="static")
    first, *steps, _ = counts.steps
    assert steps and all(step.reads <= step.draft_passes + 2 for step in steps), [
        (s.reads, s.draft_passes) for s in counts.steps]


@pytest.mark.parametrize("fault", list(FAULTS.values()), ids=list(FAULTS))
def test_an_exception_leaves_only_committed_tokens_in_a_static_cache(fault):
    """As with a dynamic cache (tests/test_faults.py): the write length drops back to the committed tokens, whose
    rows are plain's, and the next call with the same cache decodes plain's tokens."""
    target = tiny_model("qwen2", 0)
    draft = copy.deepcopy(target)
    ids = random_prompt(torch.Generator().manual_seed(7), 6)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    cache = StaticCache(config=target.config, max_cache_len=ids.shape[1] + 40 + 32)
    kwargs = fault()
    hook = _interrupt_in_layer(target, kwargs.pop("layer_interrupt")) if "layer_interrupt" in kwargs else None
    try:
        with pytest.raises((Boom, KeyboardInterrupt)):
            target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False, **cache_arg(cache),
                            speculation="tree", **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    rows = cache_length(cache)
    assert rows < plain.shape[1] and all(layer_rows(layer) == rows for layer in cache.layers)
    if rows:
        reference = DynamicCache()
        with torch.no_grad():
            target(plain[:, :rows], **cache_arg(reference), use_cache=True)
        for ours, theirs in zip(cache.layers, reference.layers, strict=True):
            torch.testing.assert_close(ours.keys[:, :, :rows], theirs.keys, rtol=1e-4, atol=1e-5)
    again = target.generate(ids, assistant_model=draft, max_new_tokens=40, do_sample=False, **cache_arg(cache),
                            speculation="tree")
    assert torch.equal(again, plain)


# --------------------------------------------------------------------------- refusals, before anything runs


def test_static_cache_too_small_is_refused_up_front():
    target = tiny("Llama")
    ids = prompt()
    cache = StaticCache(config=target.config, max_cache_len=ids.shape[1] + 10)
    with pytest.raises(ValueError, match=r"max_cache_len=20 tokens.*need 29.*max_cache_len >= 29"):
        speculate(target, ids, 20, "chain", **cache_arg(cache))
    assert all(not layer.is_initialized for layer in cache.layers)  # untouched


def test_returned_attentions_on_a_static_cache_are_refused():
    """Plain static-cache generate returns attention rows as wide as the cache; ours would hold the path's columns."""
    target = tiny("Llama")
    target.config._attn_implementation = "eager"
    cache = StaticCache(config=target.config, max_cache_len=64)
    with pytest.raises(ValueError, match=r"static cache returns rows as wide as the cache.*drop output_attentions"):
        speculate(target, prompt(), 8, "chain", **cache_arg(cache), output_attentions=True)
    with pytest.raises(ValueError, match=r"cache_implementation='dynamic'"):
        speculate(target, prompt(), 8, "tree", cache_implementation="static", output_attentions=True)
    assert all(not layer.is_initialized for layer in cache.layers)  # untouched
    out = speculate(target, prompt(), 8, "chain", cache_implementation="static", output_hidden_states=True)
    assert len(out.hidden_states) == 8  # the other returned outputs stay available on a static cache


@pytest.mark.parametrize("implementation", ["offloaded_static", "quantized", "offloaded"])
def test_other_cache_implementations_are_refused(implementation):
    with pytest.raises(ValueError, match=rf"cache_implementation='{implementation}'.*'dynamic' or 'static'"):
        speculate(tiny("Llama"), prompt(), 8, "chain", cache_implementation=implementation)


# --------------------------------------------------------------------------- sampling: one step, enumerated exactly


class StaticCase(ModelCase):
    """ModelCase's tree scores from the pass the loop runs on a static cache: a StaticCache made full length,
    the tree padded to its bucket, masks as wide as the cache."""

    def tree_scores(self, tree) -> torch.Tensor:
        past = len(self.context) - 1
        cache = StaticCache(config=self.target.config.get_text_config(decoder=True), max_cache_len=past + 40)
        cache = full_length_cache(cache)
        shapes = PassShapes(cache.layers[0].max_cache_len)
        with torch.no_grad():
            self.target(self.context[None, :-1], **cache_arg(cache), use_cache=True)
            output = tree_pass(self.target, tree, past, cache, AttentionLayout.of(self.target), torch.float32,
                               torch.device("cpu"), shapes=shapes)
        assert shapes.sizes == {8}  # 5 nodes padded with 3
        return output.logits[0, : len(tree)].float() / 0.7


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, TargetSampleVerifier])
@pytest.mark.parametrize("name", ["Llama", "Gemma 3 (text)"])
def test_one_sampled_step_is_exact_on_a_static_cache(name, verifier_cls):
    case = StaticCase(family(name), 3 * WINDOW)
    spec = [[[]], [[]]]  # two children with a child each: depth 2, siblings and cousins in the mask, 3 padding rows
    got, accepted = speculative_joint(case, spec, verifier_cls(), 3, build=case.build)
    want = target_joint(case, case.prompt, 3)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert total_variation(got, want) < 1e-5
    assert accepted > 0.05


def test_sampling_on_a_static_cache_matches_the_dynamic_run():
    """Same seed, same draws: a sampled call on a static cache emits what it emits on a dynamic one. (A draft other
    than the target: with a copy, p/q sits at 1 +- rounding, and whether an acceptance draws a number at all flips.)"""
    target, draft = tiny("Qwen2"), tiny("Qwen2", 1)
    ids = prompt()
    outs = [
        target.generate(ids, assistant_model=draft, speculation="sequoia",
                        speculation_config=METHODS["sequoia"], do_sample=True, temperature=0.8, max_new_tokens=24,
                        speculation_generator=torch.Generator().manual_seed(5), cache_implementation=impl)
        for impl in ("dynamic", "static")
    ]
    assert torch.equal(outs[0], outs[1])


# --------------------------------------------------------------------------- compiled forwards


def compile_config(backend: str) -> CompileConfig:
    config = CompileConfig(backend=backend, mode=None if backend != "inductor" else "default")
    config._compile_all_devices = True  # Transformers' switch for compiling on a CPU, as plain generate reads it
    return config


@pytest.mark.parametrize("method", ["chain", "specexec"])
def test_compile_config_is_honoured_with_few_graphs(method):
    """compile_config reaches the tree passes through Transformers' own compiled call; the output stays plain's, and
    the graphs stay few (dynamo compiles one per bucket at most, and turns to a dynamic-size graph after two)."""
    target = tiny("Llama")
    ids, n = prompt(), 40
    config = compile_config("aot_eager")
    expected = plain_static(target, ids, n, compile_config=config)
    torch._dynamo.reset()
    out = speculate(target, ids, n, method, cache_implementation="static", compile_config=config)
    stats = out.speculation_stats
    assert torch.equal(out.sequences, expected)
    # one graph per padded size of each model at most (dynamo turns a size dynamic after two)
    assert stats.compiled and 1 <= stats.graphs_compiled <= (min(len(stats.tree_pass_sizes), 3)
                                                             + min(len(stats.draft_pass_sizes), 3))
    assert stats.sizes_kept_eager <= stats.tree_pass_sizes and stats.draft_sizes_kept_eager <= stats.draft_pass_sizes
    again = speculate(target, ids, n, method, cache_implementation="static", compile_config=config)
    assert torch.equal(again.sequences, expected) and again.speculation_stats.graphs_compiled == 0  # all reused


def test_a_shorter_prompt_reuses_the_graphs_of_a_longer_one():
    """Transformers sizes each call's static cache to the longest call so far, so a compiled plain forward keeps its
    shapes; the tree room goes on top of those rows, so a speculative call with a shorter prompt compiles nothing."""
    target = tiny("Llama")
    config = CompileConfig(backend="eager", dynamic=False)
    config._compile_all_devices = True
    long, short = prompt(length=20), prompt(length=12, seed=1)
    torch._dynamo.reset()
    first = speculate(target, long, 24, "chain", cache_implementation="static", compile_config=config)
    assert first.speculation_stats.graphs_compiled >= 1
    out = speculate(target, short, 24, "chain", cache_implementation="static", compile_config=config)
    assert out.speculation_stats.graphs_compiled == 0
    assert torch.equal(out.sequences, plain_static(target, short, 24))


def test_sizes_compile_past_dynamos_recompile_limit():
    """Every model's forward is one function to dynamo (Transformers' `can_return_tuple` wrapper), which compiles
    `recompile_limit` graphs of it and then runs it eagerly: a target and a draft at a few sizes each pass that limit,
    and each new size still gets its graph."""
    target = tiny("Llama")
    config = CompileConfig(backend="eager", dynamic=False)
    config._compile_all_devices = True
    ids, n = prompt(), 24
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):  # (a config module: monkeypatch would delete the entry)
        out = speculate(target, ids, n, "specexec", cache_implementation="static", compile_config=config)
        assert torch._dynamo.config.recompile_limit == 1  # the user's setting is back after each warm-up
    stats = out.speculation_stats
    sizes = len(stats.tree_pass_sizes) + len(stats.draft_pass_sizes)
    assert sizes >= 3 and stats.graphs_compiled >= sizes  # one graph per size of each model, none refused
    assert torch.equal(out.sequences, plain_static(target, ids, n))


def test_the_guard_does_not_judge_a_step_that_compiled(monkeypatch):
    """A step whose forward compiled a graph took seconds of compiling, not of decoding: the guard skips it."""
    from torch._dynamo.utils import counters

    from hf_specdec.draft.guarded import GuardedDrafter

    seen, prompts = [], []

    class Inner:
        forward_count, forward_time = 0, 0.0

        def propose(self, input_ids):
            return TokenTree.from_parents([int(input_ids[0, -1]), 5], [-1, 0])

        def accept(self, input_ids, tree, verdict):
            pass

    class Recording:
        def observe(self, *args):
            seen.append(args)

        def observe_first(self, seconds, tokens, draft_seconds, prompt_tokens):
            prompts.append((draft_seconds, prompt_tokens))

        def plain_next(self):
            return False

    drafter, ids = GuardedDrafter(Inner(), Recording()), torch.tensor([[3, 4]])
    verdict = type("Verdict", (), {"path": [0, 1]})()
    monkeypatch.setitem(counters["stats"], "unique_graphs", counters["stats"]["unique_graphs"])
    for compiled in (False, False, True, False, False):
        tree = drafter.propose(ids)
        counters["stats"]["unique_graphs"] += compiled  # what dynamo does when the target pass compiles
        drafter.accept(ids, tree, verdict)
    drafter.propose(ids)
    assert len(seen) == 3  # of 5 steps, the call's first (its draft pass reads the prompt: observed apart) and the
    # one that compiled are not observed as steps
    assert prompts == [(0.0, 2)]  # the first step's draft time, its pass reading the 2 prompt tokens


def test_no_compile_without_a_compile_config_on_cpu():
    """As plain generate: on a CPU a static cache alone does not compile."""
    out = speculate(tiny("Llama"), prompt(), 8, "chain", cache_implementation="static")
    assert not out.speculation_stats.compiled and out.speculation_stats.graphs_compiled == 0


def test_forward_the_user_compiled_works():
    target = copy.deepcopy(tiny("Gemma 3 (text)"))
    ids, n = prompt(), 24
    expected = plain_static(target, ids, n)
    target.forward = torch.compile(target.forward, backend="eager")
    out = speculate(target, ids, n, "tree", cache_implementation="static")
    assert torch.equal(out.sequences, expected) and not out.speculation_stats.compiled


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_a_compiled_pass_runs_only_at_sizes_where_it_measured_faster(compiled_faster, monkeypatch):
    """The first pass of a size tries both calls over the same cache rows (the write length rewound between them)
    and keeps the faster; later passes of that size run it alone. The cache ends as after one pass either way."""
    from hf_specdec.runtime import faster_call
    from hf_specdec.runtime.faster_call import FasterCall

    target = tiny("Llama")
    ids, layout = prompt(), AttentionLayout.of(target)
    cache = StaticCache(config=target.config, max_cache_len=32)
    with torch.no_grad():
        reference = target(ids, **cache_arg(cache), use_cache=True).logits
    crop(cache, 4)
    calls = []

    def counted(name, delay):
        def call(**inputs):
            calls.append(name)
            clock[0] += delay  # the slower call's pass takes longer on the mocked clock
            return target(**inputs)
        return call

    clock = [0.0]
    monkeypatch.setattr(faster_call.time, "perf_counter", lambda: clock[0])
    fast, slow = (1.0, 2.0) if compiled_faster else (2.0, 1.0)
    forward = FasterCall(counted("eager", slow), counted("compiled", fast), torch.device("cpu"))
    tree = TokenTree.from_parents(ids[0, 4:8].tolist(), [-1, 0, 1, 2])
    for _ in range(2):
        with torch.no_grad():
            out = tree_pass(target, tree, 4, cache, layout, target.dtype, torch.device("cpu"), shapes=PassShapes(32),
                            forward=forward)
        torch.testing.assert_close(out.logits[0], reference[0, 4:8], atol=1e-5, rtol=1e-5)
        assert cache_length(cache) == 8
        crop(cache, 4)
    kept = "compiled" if compiled_faster else "eager"
    assert calls == ["compiled", *["eager", "compiled"] * faster_call.TRIALS, kept]  # warm-up, trials, then one
    assert forward.choice == {4: compiled_faster} and forward.kept_eager() == (set() if compiled_faster else {4})


@pytest.mark.slow
def test_inductor_compiled_run_is_identical():
    """A real inductor compile (CPU, C++ codegen; about a minute here): same tokens as plain compiled generate."""
    target = tiny("Llama")
    ids, n = prompt(), 24
    config = compile_config("inductor")
    expected = plain_static(target, ids, n, compile_config=config)
    torch._dynamo.reset()
    out = speculate(target, ids, n, "sequoia", cache_implementation="static", compile_config=config)
    stats = out.speculation_stats
    assert torch.equal(out.sequences, expected)
    assert stats.compiled and 1 <= stats.graphs_compiled <= len(stats.tree_pass_sizes) + len(stats.draft_pass_sizes)


# --------------------------------------------------------------------------- the real pair


@pytest.mark.real
def test_real_pair_on_a_static_cache_equals_plain_static_generate(real_pair_fp32):
    from hf_specdec_tools.prompts import humaneval_prompts

    target, draft, tokenizer = real_pair_fp32
    ids = tokenizer(humaneval_prompts(1)[0], return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=48, do_sample=False, cache_implementation="static")
    out = target.generate(ids, assistant_model=draft, speculation="specexec", max_new_tokens=48, do_sample=False,
                          speculation_config={"budget": 32, "max_depth": 8}, cache_implementation="static",
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.target_forwards < 48 / 2
    assert out.speculation_stats.tree_pass_sizes == {32}  # one shape for the whole call
    assert out.speculation_stats.draft_pass_sizes  # the draft on a static cache too


def test_a_chain_cut_short_by_its_confidence_stop_on_a_static_cache():
    """`chain`'s confidence stop on a static cache: steps draft chains of different lengths (padded passes of several
    sizes, slots of levels never run left out), and the output is plain static generate's."""
    target = tiny("Llama")
    ids, n = prompt(), new_tokens(family("Llama"))
    out = target.generate(ids, assistant_model=copy.deepcopy(target), speculation="chain", do_sample=False,
                          speculation_config={"num_draft_tokens": 6, "confidence_threshold": 0.05}, max_new_tokens=n,
                          cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain_static(target, ids, n))
    steps = out.speculation_stats.tokens_per_step
    assert max(steps) > 2 and min(steps[:-1]) < 7, steps  # some chains ran deeper than one token, some stopped short
