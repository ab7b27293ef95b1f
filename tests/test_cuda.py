"""On a CUDA GPU: lossless greedy in float32 for every method and attention kernel, seeded sampling reproducible,
the sampling verifiers exact with their draws on the device, flash-attention refused, a static cache with CUDA
graphs identical to plain static generate, a padded batch identical to plain batched generate.

CI has no GPU; these run on a GPU machine with one command (docs/gpu.md):

    python -m pytest -m cuda tests/test_cuda.py
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from hf_specdec.accept.kv_cache import keep_positions
from hf_specdec.decoding import loop, step
from tests.conftest import random_prompt, tiny_model
from tests.helpers.batches import kwargs_for, near_draft, padded_batch
from tests.helpers.exactness import (
    WALKING,
    Case,
    chi_square_pvalue,
    sample_step,
    target_joint,
    total_variation,
)
from tests.helpers.lean import PAIRS as LEAN_FAMILIES
from tests.helpers.lean import assert_lean_pass_equals_the_model
from tests.helpers.methods import GREEDY as METHODS  # the five methods at fixed shapes

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9}


def cuda_pair(attn: str = "sdpa") -> tuple[torch.nn.Module, torch.nn.Module]:
    return tiny_model("llama", 0, attn=attn).cuda(), tiny_model("llama", 1, attn=attn).cuda()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_greedy_float32_identical_to_plain(name, attn):
    target, draft = cuda_pair(attn)
    for seed, length in ((0, 5), (1, 40)):
        ids = random_prompt(torch.Generator().manual_seed(seed), length).cuda()
        plain = target.generate(ids, do_sample=False, max_new_tokens=40)
        out = target.generate(ids, assistant_model=draft, speculation=METHODS[name], do_sample=False,
                              max_new_tokens=40, return_dict_in_generate=True)
        assert out.sequences.device.type == "cuda"
        assert torch.equal(out.sequences, plain), (name, attn, seed)
        assert out.speculation_stats.draft_forwards > 0  # the draft ran: the trees were verified on the GPU


@pytest.mark.parametrize("name", ["chain", "sequoia", "specexec"])
def test_greedy_float32_batch_identical_to_plain_batched(name, monkeypatch):
    """A left-padded batch, each row's tree passes on the GPU through the lean target pass (the loop's default
    off the CPU): every row's tokens are plain batched generate's."""
    calls, run = [], step.LeanPass.__call__
    monkeypatch.setattr(step.LeanPass, "__call__", lambda self, *args: calls.append(args[0].shape) or run(self, *args))
    target = tiny_model("llama", 0)
    draft = near_draft(target).cuda()  # its noise drawn on the host, as in the CPU tests
    target = target.cuda()
    ids, mask = padded_batch(3, [0, 3, 5])
    ids, mask = ids.cuda(), mask.cuda()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **kwargs_for(name, draft))
    assert torch.equal(out, plain), name
    assert any(sequences == 3 and rows > 1 for sequences, rows in calls)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_seeded_sampling_reproducible_with_processors_on_the_device(name):
    target, draft = cuda_pair()
    ids = random_prompt(torch.Generator().manual_seed(2), 9).cuda()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(target.generate(ids, assistant_model=draft, speculation=METHODS[name], max_new_tokens=30,
                                    **SAMPLING))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape[1] == ids.shape[1] + 30 and int(runs[0].max()) < target.config.vocab_size


@pytest.mark.parametrize("verifier_cls", WALKING)
def test_sampling_verifier_exact_on_the_device(verifier_cls):
    """The CPU Monte-Carlo test of tests/test_sampling_exact.py with every row, tree and draw on the GPU."""
    case = Case(seed=3, vocab=5, banned=0.2)
    want = target_joint(case, case.prompt, 2)
    case.target_scores = on_device(case.target_scores, torch.device("cuda"))
    case.draft_q = on_device(case.draft_q, torch.device("cuda"))
    torch.manual_seed(1234)
    n, counts = 2500, defaultdict(int)
    for _ in range(n):
        counts[sample_step(case, [2, 2], verifier_cls(), None)] += 1
    assert chi_square_pvalue(counts, want, n) > 1e-3
    assert total_variation({k: c / n for k, c in counts.items()}, want) < 0.04


def on_device(function, device: torch.device):
    """`function(prefix)` moved to `device`, computed once per prefix (the toy models are slow to evaluate)."""
    store: dict = {}
    return lambda prefix: store[prefix] if prefix in store else store.setdefault(prefix, function(prefix).to(device))


def test_flash_attention_refused_before_any_pass():
    target, draft = cuda_pair()
    target.config._attn_implementation = "flash_attention_2"
    ids = random_prompt(torch.Generator().manual_seed(3), 7).cuda()
    with pytest.raises(ValueError, match="flash_attention_2.*attn_implementation='sdpa'"):
        target.generate(ids, assistant_model=draft, speculation="chain", max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("name", ["chain", "specexec"])
def test_static_cache_with_cuda_graphs_identical_to_plain_static(name):
    """On a GPU a static cache makes Transformers compile the forward (inductor, CUDA graphs); the tree passes and the
    draft's passes (its own static cache) run compiled graphs too, and the tokens stay plain static generate's."""
    target, draft = cuda_pair()
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    plain = target.generate(ids, do_sample=False, max_new_tokens=32, cache_implementation="static")
    for _ in range(2):  # the second call replays the graphs the first one captured
        out = target.generate(ids, assistant_model=draft, speculation=METHODS[name], do_sample=False,
                              max_new_tokens=32, cache_implementation="static", return_dict_in_generate=True)
        stats = out.speculation_stats
        assert torch.equal(out.sequences, plain), name
        assert stats.compiled and stats.draft_pass_sizes, stats  # compiled target, draft on its static cache


@pytest.mark.parametrize("name", ["chain", "tree", "sequoia", "specexec"])
def test_a_captured_step_compiled_whole_is_plain_static_generate(name):
    """`captured=True` on a GPU with a static cache: the step compiled whole with the call's compile config
    (mode="reduce-overhead": CUDA graphs, one per shape), replayed by a second call; plain static generate's tokens
    (`specexec`: its tree grown best first inside the graph)."""
    from tests.test_captured import EVERY_SHAPE as SHAPES

    target, draft = cuda_pair()
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    plain = target.generate(ids, do_sample=False, max_new_tokens=32, cache_implementation="static")
    for _ in range(2):
        out = target.generate(ids, assistant_model=draft, speculation=name, do_sample=False, max_new_tokens=32,
                              speculation_config={**SHAPES[name], "captured": True, "guard": False},
                              cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), name
        assert out.speculation_stats.compiled and out.speculation_stats.graphs_compiled >= 1


def test_a_captured_step_with_a_repetition_penalty_compiled_whole_is_plain_static_generate():
    """A repetition penalty on every node's fixed-width ids inside the CUDA graph (the sequence's buffer written by
    the verdict on the device): plain static generate's tokens, with the target as its draft and another, each call
    run twice (the second replays the graphs)."""
    from tests.test_captured import PROCESSED, SHAPES

    target, draft = cuda_pair()
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    plain = target.generate(ids, do_sample=False, max_new_tokens=32, cache_implementation="static", **PROCESSED)
    for assistant in (target, target, draft, draft):
        out = target.generate(ids, assistant_model=assistant, speculation="tree", do_sample=False, max_new_tokens=32,
                              speculation_config={**SHAPES["tree"], "captured": True, "guard": False},
                              cache_implementation="static", return_dict_in_generate=True, **PROCESSED)
        assert torch.equal(out.sequences, plain)
        assert out.speculation_stats.compiled


@pytest.mark.parametrize("name", ["chain", "sequoia"])
def test_captured_steps_sized_every_step_compile_a_graph_per_bucket_at_most(name):
    """`chain` and `sequoia` at their defaults, captured: each step's shape one of the buckets' (or the root alone),
    each compiled once (CUDA graphs), a second call replaying them; plain static generate's tokens."""
    from hf_specdec.plan.shape_sizing import CAPTURED_SIZES

    target, draft = cuda_pair()
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    plain = target.generate(ids, do_sample=False, max_new_tokens=32, cache_implementation="static")
    for _ in range(2):
        out = target.generate(ids, assistant_model=draft, speculation=name, do_sample=False, max_new_tokens=32,
                              speculation_config={"captured": True, "guard": False},
                              cache_implementation="static", return_dict_in_generate=True)
        stats = out.speculation_stats
        assert torch.equal(out.sequences, plain), name
        assert stats.compiled and 1 <= stats.graphs_compiled <= len(CAPTURED_SIZES) + 1, stats.graphs_compiled


@pytest.mark.parametrize("name", ["chain", "sequoia"])
def test_captured_plain_steps_among_trees_compiled_are_plain_static_generate(name, monkeypatch):
    """Plain steps (the root alone: the guard's or a sized schedule's) among trees, compiled on a GPU: the plain step is
    a CUDA graph of its own and the draft's eager catch-up runs between graphs; plain static generate's tokens, with
    the target as its draft the tree after plain steps still kept whole, call after call."""
    from tests.helpers.plain_steps import plain_steps_where
    from tests.test_captured import SHAPES

    pattern = [True, False, True, True, False]
    plain_steps_where(monkeypatch, lambda step: pattern[step % len(pattern)])
    target, draft = cuda_pair()
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    plain = target.generate(ids, do_sample=False, max_new_tokens=32, cache_implementation="static")
    for assistant in (draft, target, target):
        out = target.generate(ids, assistant_model=assistant, speculation=name, do_sample=False, max_new_tokens=32,
                              speculation_config={**SHAPES[name], "captured": True, "guard": False},
                              cache_implementation="static", return_dict_in_generate=True)
        stats = out.speculation_stats
        assert torch.equal(out.sequences, plain), name
        assert stats.compiled and stats.graphs_compiled >= 2 and stats.plain_steps > 2
    trees = [tokens for index, tokens in enumerate(stats.tokens_per_step) if not pattern[index % len(pattern)]]
    assert all(tokens == trees[0] > 2 for tokens in trees[:-1]), stats.tokens_per_step


@pytest.mark.parametrize("name", ["chain", "tree", "sequoia"])
def test_a_captured_sampled_step_compiled_whole_keeps_the_whole_depth_with_the_target_as_draft(name):
    """Sampled, compiled whole on a GPU (the draws, processors and walk inside the CUDA graph): with the target as its
    own draft every step keeps the shape's deepest path (p / q = 1 at every node), call after call."""
    from tests.test_captured import SHAPES

    target = cuda_pair()[0]
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    for _ in range(2):
        out = target.generate(ids, assistant_model=target, speculation=name, do_sample=True, temperature=0.9,
                              top_k=20, max_new_tokens=32, cache_implementation="static", return_dict_in_generate=True,
                              speculation_config={**SHAPES[name], "captured": True, "guard": False})
        steps = out.speculation_stats.tokens_per_step
        assert out.sequences.shape[1] == ids.shape[1] + 32 and steps[0] > 2
        assert all(tokens == steps[0] for tokens in steps[:-1]), (name, steps)


def test_a_captured_sampled_grown_tree_compiled_whole_keeps_a_token_every_step():
    """`specexec` sampled, compiled whole on a GPU (the processed draft rows, the draws at every node and the walk
    inside the CUDA graph): with the target as its draft and top_k equal to the width, every step's draw at the root
    lands on one of its children, so each step keeps at least 2 tokens, call after call."""
    target = cuda_pair()[0]
    ids = random_prompt(torch.Generator().manual_seed(4), 12).cuda()
    for _ in range(2):
        out = target.generate(ids, assistant_model=target, speculation="specexec", do_sample=True, temperature=0.9,
                              top_k=8, max_new_tokens=32, cache_implementation="static", return_dict_in_generate=True,
                              speculation_config={"budget": 16, "captured": True, "guard": False})
        steps = out.speculation_stats.tokens_per_step
        assert out.sequences.shape[1] == ids.shape[1] + 32 and out.speculation_stats.compiled
        assert all(tokens >= 2 for tokens in steps[:-1]), steps


@pytest.mark.parametrize("name", ["tree", "sequoia", "specexec"])
def test_first_child_paths_kept_in_place_on_the_gpu(name, monkeypatch):
    """On a GPU the target gets its tree depth first (`core.pass_shapes.depth_first`): with the target as its own
    draft every accepted path follows first children, and the compaction cuts the cache without moving a row."""
    target, calls = cuda_pair()[0], []

    def recording(cache, start, kept):
        calls.append((start, list(kept)))
        return keep_positions(cache, start, kept)

    monkeypatch.setattr(loop, "keep_positions", recording)
    ids = random_prompt(torch.Generator().manual_seed(3), 9).cuda()
    out = target.generate(ids, assistant_model=target, speculation=METHODS[name], do_sample=False, max_new_tokens=24)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=24))
    assert any(len(kept) > 2 for _, kept in calls)
    assert all(kept == list(range(start, start + len(kept))) for start, kept in calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LEAN_FAMILIES))
def test_lean_draft_pass_equals_the_model_on_the_gpu(name, dtype):
    """The draft's lean pass (`kernels/lean_pass.py`) on CUDA: the model's own logits and cache writes on a tree, in
    float32 to rounding and in bfloat16 to its precision (the fused `F.rms_norm` rounds once, not per op)."""
    model = LEAN_FAMILIES[name]().to("cuda", dtype)
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert_lean_pass_equals_the_model(model, 0, **tolerance)
