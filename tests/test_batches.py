"""Speculation on a batch (issue 25): left-padded prompts of different lengths, each row its own tree and its own
acceptance every step, greedy output identical row by row to plain batched `generate` (float32, tiny models),
sampled rows scored on their own sequences, finished rows leaving the batch, refusals up front."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import DynamicCache, pipeline

from hf_specdec.core.releases import output_cache
from hf_specdec.decoding import batch_loop, step
from hf_specdec.logits import processing
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.sizing import HardwareProfile, for_batch
from tests.conftest import TINY_CONFIGS, VOCAB, tiny_model
from tests.helpers.batches import (
    NEW,
    WHOLE_CHAIN_3,
    eos_firing_in_one_row,
    flat_until,
    hooked_chain_call,
    kwargs_for,
    near_draft,
    padded_batch,
    sized_batch,
)
from tests.tiny import tiny_tokenizer

METHODS = ["chain", "tree", "sequoia", "sequoia-online", "specexec", "staged", "prompt_lookup"]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def near_pair(request):
    target = tiny_model(request.param, 0)
    return target, near_draft(target)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stop", ["max_new_tokens", "eos"])
def test_greedy_batch_equals_plain_batched_generate_row_by_row(near_pair, method, stop):
    target, draft = near_pair
    ids, mask = padded_batch(3, [0, 3, 5])
    eos = eos_firing_in_one_row(target, ids, mask) if stop == "eos" else None
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    plain = target.generate(ids, **call)
    out = target.generate(ids, **call, **kwargs_for(method, draft), return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    if stop == "eos":  # row 1 ended early: plain wrote pad tokens after its eos, and so does the batch
        assert (plain[1] == eos).any() and plain[1, -1] == 0
    stats = out.speculation_stats
    if method == "sequoia-online" and not isinstance(stats, list):  # sized for the batch, no tree paid: plain
        assert "decoded plainly" in stats.plan_source
        return
    assert isinstance(stats, list), stats.plan_source
    assert len(stats) == 3 and all(row.new_tokens > 0 for row in stats)
    steps = [row.tokens_per_step for row in stats]
    if method != "sequoia-online":  # its plan, calibrated on tiny models, may rightly be the root alone
        assert max(max(row) for row in steps) > 1  # drafted tokens were accepted
    if method in ("chain", "tree"):  # in one step, rows accepted different numbers of tokens
        assert any(len({row[i] for row in steps if i < len(row)}) > 1 for i in range(max(map(len, steps))))
    assert isinstance(output_cache(out), DynamicCache)  # plain's layout: tests/test_batch_cache.py


@pytest.mark.parametrize("method", ["chain", "tree", "specexec"])
@pytest.mark.parametrize("processor", ["repetition_penalty", "prefix_allowed_tokens_fn"])
def test_processors_with_per_row_state_see_their_own_row(near_pair, method, processor):
    """Plain batched generate builds a repetition penalty that skips each row's own left padding (one ignore length
    per row), and calls a prefix constraint with each row's batch id: every row's tree nodes, the target's and the
    draft's, are scored with its own (greedy output equal to plain's)."""
    target, draft = near_pair
    ids, mask = padded_batch(3, [0, 3, 5])

    def allowed(batch_id: int, sentence: torch.Tensor) -> list[int]:  # each row its own vocabulary
        return list(range(3 + batch_id, VOCAB, 1 + batch_id))

    extra = {"repetition_penalty": 1.3} if processor == "repetition_penalty" else {"prefix_allowed_tokens_fn": allowed}
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, **extra)
    assert torch.equal(target.generate(ids, **call, **kwargs_for(method, draft)), target.generate(ids, **call))


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_a_prefix_constraint_gets_plain_batch_ids_with_several_sequences_per_prompt(near_pair, method):
    """With num_return_sequences > 1, plain generate calls `prefix_allowed_tokens_fn` with the batch id the release
    gives each expanded row (Transformers 5.23: the row; 5.24 on: its prompt's index): so does speculation."""
    target, draft = near_pair
    ids = torch.tensor([[5, 9, 11, 13], [6, 10, 12, 14]])

    def calls(**kwargs) -> set[tuple[int, int]]:
        seen = set()

        def allowed(batch_id: int, sentence: torch.Tensor) -> list[int]:
            seen.add((int(sentence[0]), batch_id))  # (which prompt the row continues, the id it is called with)
            return list(range(3, VOCAB))

        torch.manual_seed(0)
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=True,
                        num_return_sequences=2, prefix_allowed_tokens_fn=allowed, **kwargs)
        return seen

    plain = calls()
    assert {prompt for prompt, _ in plain} == {5, 6}
    assert calls(**kwargs_for(method, draft)) == plain


def test_stop_strings_stop_each_row_as_plain_does(near_pair, stop_tokenizer):
    target, draft = near_pair
    ids, mask = padded_batch(3, [0, 3, 5])
    token = eos_firing_in_one_row(target, ids, mask)
    stop = stop_tokenizer.decode([token])
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=2, stop_strings=[stop],
                tokenizer=stop_tokenizer)
    plain = target.generate(ids, **call)
    assert (plain == 0).sum() > (mask == 0).sum()  # some row stopped early and was padded
    assert torch.equal(target.generate(ids, **call, assistant_model=draft, speculation="chain"), plain)


def test_finished_rows_leave_the_batch():
    target = tiny_model("llama", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(3, [0, 3, 5])
    eos = eos_firing_in_one_row(target, ids, mask)
    rows_per_pass = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: rows_per_pass.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                              assistant_model=draft, speculation="chain")
    finally:
        hook.remove()
    assert rows_per_pass[0] == 3 and rows_per_pass[-1] < 3 and sorted(rows_per_pass, reverse=True) == rows_per_pass
    assert (out[1] == eos).any()


def test_sampled_rows_are_scored_on_their_own_sequence(monkeypatch):
    """Each row's verifier gets, for every node of its tree, the target's processed scores after that row's own
    prompt and path (the distribution an exact verifier needs; the verifiers' exactness is enumerated in
    test_sampling_exact.py), whatever the other rows' padding, holes and tree sizes."""
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(5, [0, 4])
    seen = []
    original = processing.NodeScores

    class Recording(original):
        def __init__(self, *args):
            super().__init__(*args)
            seen.append(self)

    monkeypatch.setattr(step, "NodeScores", Recording)  # where a step scores every row's tree
    torch.manual_seed(0)
    target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20,
                    assistant_model=draft, speculation="tree", speculation_config={"widths": [2, 2]})
    assert len(seen) >= 4
    processors = seen[0].processors
    for scores in seen:
        prefix = scores.prefix_ids  # the padded row up to the root, as plain's processors see it
        real = prefix[:, (prefix[0] != 0).nonzero()[0, 0]:]  # prompts hold no pad id: leading zeros are padding
        for node in range(len(scores.tree)):
            path = scores.tree.prefix_tokens([node])
            with torch.no_grad():
                logits = target(torch.cat([real, path], dim=1)).logits[:, -1]
            expected = processors(torch.cat([prefix, path], dim=1), logits.float())
            assert torch.allclose(scores[node][None], expected, atol=1e-4)


def test_num_return_sequences_expands_to_a_batch():
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    ids, _ = padded_batch(7, [0])
    torch.manual_seed(0)
    out = target.generate(ids, max_new_tokens=10, do_sample=True, num_return_sequences=3, assistant_model=draft,
                          speculation="chain", return_dict_in_generate=True)
    assert out.sequences.shape == (3, ids.shape[1] + 10)
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids.expand(3, -1))
    assert len(out.speculation_stats) == 3


def test_pipeline_with_batch_size_two_equals_plain():
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "left"
    prompts = ["w7 w8 w9 w10 w11", "w12 w13", "w20 w21 w22"]
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=2)(
        prompts, max_new_tokens=12, do_sample=False, return_tensors=True)
    spec = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=2, assistant_model=draft)(
        prompts, max_new_tokens=12, do_sample=False, return_tensors=True, speculation="chain")
    assert spec == plain
    # the pipeline's own defaults sample (do_sample=True, temperature=0.7): every prompt gets its continuation
    torch.manual_seed(0)
    sampled = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=2, assistant_model=draft)(
        prompts, max_new_tokens=12, return_tensors=True, speculation="chain")
    assert [len(out[0]["generated_token_ids"]) for out in sampled] == [len(out[0]["generated_token_ids"])
                                                                        for out in plain]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(right_padded=True), "needs left padding"),
        (dict(streamer="streamer"), "A streamer takes one sequence"),
        (dict(return_dict_in_generate=True, output_scores=True), "does not support output_scores"),
        (dict(cache_implementation="static"), "static cache"),
        (dict(stop_strings=["w9"], tokenizer="tokenizer", eos_token_id=None), "no eos_token_id"),
    ],
    ids=["right-padding", "streamer", "scores", "static-cache", "stop-strings-without-eos"],
)
def test_batch_refusals_name_the_problem_and_leave_no_state(call, message, stop_tokenizer):
    from transformers import TextStreamer

    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    tokenizer = stop_tokenizer
    ids, mask = padded_batch(3, [0, 2])
    call = dict(call)
    if call.pop("right_padded", False):
        mask = mask.flip(1)
    if call.get("streamer") == "streamer":
        call["streamer"] = TextStreamer(tokenizer)
    if call.get("tokenizer") == "tokenizer":
        call["tokenizer"] = tokenizer
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant_model=draft,
                        speculation="chain", **call)
    assert all(torch.equal(tensor, before[name]) for name, tensor in target.state_dict().items())
    assert target.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False).shape == (2, 12)


def test_fixed_shapes_draft_all_rows_in_lockstep():
    """chain/tree/sequoia draft every row in the same passes: per step, one pass that feeds each row what it emitted
    (and gives its root's logits) plus one per deeper level, whatever the batch size (`guard=False`: the shape
    whole every step, never sized for the batch)."""
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(4, [0, 2, 4, 6])
    rows_per_pass = []
    hook = draft.register_forward_pre_hook(
        lambda module, args, kwargs: rows_per_pass.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                              speculation="chain", speculation_config=WHOLE_CHAIN_3,
                              return_dict_in_generate=True)
    finally:
        hook.remove()
    steps = max(row.target_forwards for row in out.speculation_stats)
    assert len(rows_per_pass) == 3 * steps == out.speculation_stats[0].draft_forwards
    assert rows_per_pass[0] == 4


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_confident_chain_stops_the_batch_where_its_rows_are_unsure(near_pair, do_sample):
    """A chain's `confidence_threshold` on a batch: the next level is drafted while the rows' chains are, averaged,
    at least that likely to go on. Greedy, every row equals plain batched decoding; a threshold above every draft
    probability drafts one level a step, one at 0 the whole chain, one among the draft's own probabilities in
    between."""
    target, draft = near_pair
    ids, mask = padded_batch(5, [0, 2, 4])
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=do_sample)
    plain = target.generate(ids, **call) if not do_sample else None
    passes = {}
    middle = 0.02 if do_sample else 0.06  # within the tiny draft's own probabilities (sampling's processed lower)
    for threshold in (0.0, middle, 0.999):
        torch.manual_seed(0)
        out = target.generate(ids, **call, assistant_model=draft, speculation="chain", return_dict_in_generate=True,
                              speculation_config={"num_draft_tokens": 6, "confidence_threshold": threshold,
                                                  "guard": False})
        assert plain is None or torch.equal(out.sequences, plain)
        steps = max(row.target_forwards for row in out.speculation_stats)  # rows that finish leave the batch
        passes[threshold] = out.speculation_stats[0].draft_forwards / steps  # draft passes per step (every row's)
    assert passes[0.0] == 6 and passes[0.999] == 1  # one pass feeds the emitted tokens and gives the roots' logits
    assert 1 < passes[middle] < 6


def test_a_batch_of_one_prompt_repeated_stops_its_chain_where_the_single_sequence_does(near_pair):
    """Rows that are all the same prompt average to each row's own probabilities, so the batch's confidence stop
    drafts, step by step, the levels the single sequence's stop drafts: the same draft passes and target steps."""
    target, draft = near_pair
    ids, _ = padded_batch(5, [0])
    # the tiny draft: 2-10% sure; the threshold fixed on both sides (a single sequence can learn it, a batch cannot)
    config = {"num_draft_tokens": 6, "confidence_threshold": 0.06, "guard": False, "adapt_threshold": False}
    call = dict(max_new_tokens=NEW, assistant_model=draft, speculation="chain", return_dict_in_generate=True,
                speculation_config=config)
    single = target.generate(ids, **call).speculation_stats
    batch = target.generate(ids.repeat(3, 1), attention_mask=torch.ones(3, ids.shape[1], dtype=torch.long),
                            **call).speculation_stats
    assert 1 < single.draft_forwards / single.target_forwards < 6  # the stop cut some chains, not all
    assert [(row.draft_forwards, row.target_forwards) for row in batch] == [
        (single.draft_forwards, single.target_forwards)] * 3


@pytest.mark.parametrize("config", [{"budget": 12, "beams": 3}, {}], ids=["budget", "sized"])
def test_a_batch_of_one_prompt_repeated_grows_the_single_sequences_specexec_trees_in_its_passes(near_pair, config):
    """`specexec` in a batch grows every row's best-first tree in lockstep: each round's draft pass forwards every
    row's frontier. Rows that are all the same prompt grow the same tree in every row, each step in one draft pass
    for all rows plus one a round (drafted row by row: three times as many), and emit what the single sequence emits.
    With a fixed budget the trees are the single sequence's own, pass for pass; sized every step, each row's cost
    model prices the batch's passes on timings of its own (on the tiny pair often the roots' children alone), so only
    the per-step pass count is compared."""
    from hf_specdec.methods.specexec.lockstep import LockstepBestFirstDrafter

    target, draft = near_pair
    ids, _ = padded_batch(6, [0])
    call = dict(max_new_tokens=NEW, assistant_model=draft, speculation="specexec", return_dict_in_generate=True,
                speculation_config={**config, "guard": False}, do_sample=False)
    trees, steps, passes, rounds = [], [], [], []
    propose, frontier_pass = LockstepBestFirstDrafter.propose, LockstepBestFirstDrafter._frontier_pass

    def seen(self, *args):
        before, rounds[:] = len(passes), []
        proposed = propose(self, *args)
        steps.append((len(passes) - before, len(rounds)))
        trees.append([(tree.host(tokens=True).parents, tree.host().tokens) for tree in proposed])
        return proposed

    def counted(self, *args):
        rounds.append(1)
        return frontier_pass(self, *args)

    hook = draft.register_forward_hook(lambda *_: passes.append(1))
    try:
        single = target.generate(ids, **call)
        single_passes, passes[:] = len(passes), []
        LockstepBestFirstDrafter.propose, LockstepBestFirstDrafter._frontier_pass = seen, counted
        batch = target.generate(ids.repeat(3, 1), attention_mask=torch.ones(3, ids.shape[1], dtype=torch.long),
                                **call)
    finally:
        LockstepBestFirstDrafter.propose, LockstepBestFirstDrafter._frontier_pass = propose, frontier_pass
        hook.remove()
    assert torch.equal(batch.sequences, single.sequences.repeat(3, 1))
    assert trees and all(step[0] == row for step in trees for row in step)  # every row the same tree
    assert max(len(step[0][0]) for step in trees) > 2  # trees, not chains of one token
    # each step: one pass feeding every row its emitted tokens, then one pass a round for all three rows
    assert steps and all(made == 1 + grown for made, grown in steps)
    if config:  # a fixed budget: the single sequence's own trees, pass for pass
        assert max(grown for _, grown in steps) > 1  # rounds past the roots' children
        assert len(passes) <= single_passes + 2
        stats = single.speculation_stats
        assert [(row.draft_forwards, row.target_forwards) for row in batch.speculation_stats] == [
            (stats.draft_forwards, stats.target_forwards)] * 3


def test_a_batch_drafts_on_while_its_rows_chains_average_the_threshold():
    """The batch's stop after a level: a row whose own chain stopped (a token below the threshold) counts 0 from
    then on; the next level is drafted while the rows' probabilities average at least the threshold. One row sure
    of its token among eight does not keep the batch drafting; one row is the single sequence's rule exactly."""
    from hf_specdec.draft.batch_shaped import batch_goes_on

    log = torch.log
    threshold = math.log(0.4)
    going = torch.ones(8, dtype=torch.bool)
    three_sure = log(torch.tensor([0.9, 0.9, 0.9, 0.1, 0.2, 0.3, 0.35, 0.39]))
    rows, on = batch_goes_on(going, three_sure, threshold)  # 2.7 / 8 < 0.4
    assert rows.tolist() == [True] * 3 + [False] * 5 and not on
    four_sure = log(torch.tensor([0.9, 0.9, 0.9, 0.9, 0.2, 0.3, 0.35, 0.39]))
    assert bool(batch_goes_on(going, four_sure, threshold)[1])  # 3.6 / 8 >= 0.4
    stopped_rows_stay_stopped = batch_goes_on(rows, log(torch.full((8,), 0.99)), threshold)
    assert stopped_rows_stay_stopped[0].tolist() == rows.tolist() and not stopped_rows_stay_stopped[1]
    no_child = torch.full((2,), -math.inf)
    assert not batch_goes_on(torch.ones(2, dtype=torch.bool), no_child, threshold)[1]
    one = torch.ones(1, dtype=torch.bool)
    assert bool(batch_goes_on(one, torch.tensor([threshold]), threshold)[1])
    assert not batch_goes_on(one, torch.tensor([threshold]).nextafter(torch.tensor(-1.0)), threshold)[1]


def test_sequoia_trees_shrink_as_the_batch_grows():
    """Sized for a batch, a pass over B trees of n nodes costs what B * n tokens cost: bigger batches, smaller trees
    (curves measured on an unloaded Zen 4 CPU, where 8 tokens cost about what 1 does)."""
    from hf_specdec.methods.sequoia.sizing import choose_plan

    sizes = (1, 8, 16, 32, 64, 128, 256)
    profile = HardwareProfile(LatencyCurve(sizes, (0.174, 0.152, 0.221, 0.271, 0.379, 0.661, 1.257)),
                              LatencyCurve(sizes, (0.078, 0.064, 0.072, 0.100, 0.148, 0.275, 0.455)))
    acceptance = [0.7, 0.15, 0.05, 0.02]
    nodes = [len(choose_plan(acceptance, for_batch(profile, rows), 64, 8).plan.parents) for rows in (1, 2, 4, 8)]
    assert nodes == sorted(nodes, reverse=True) and nodes[-1] < nodes[0]
    assert for_batch(profile, 4).target(8) == pytest.approx(profile.target(32))


def test_the_lockstep_draft_keeps_the_accepted_nodes_it_forwarded():
    """A draft that always agrees: every row accepts the whole 3-token chain, whose first two tokens the draft
    forwarded while drafting; it keeps them, so each later step's first pass feeds each row two tokens (the chain's
    last token and the bonus), not the whole block again."""
    target = tiny_model("llama", 0)
    draft = copy.deepcopy(target)
    ids, mask = padded_batch(7, [0, 2, 4])
    widths = []
    hook = draft.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    out = hooked_chain_call(target, draft, ids, mask, hook)
    assert all(row.tokens_per_step[:-1] == [4] * (len(row.tokens_per_step) - 1) for row in out.speculation_stats)
    assert widths[0] == ids.shape[1] and len(widths) > 6 and set(widths[3::3]) == {2} and set(widths[1::3]) == {1}


def test_the_batch_cost_model_shrinks_shapes_as_the_batch_grows():
    """A pass over n nodes for each of B rows costs what B * n tokens cost on the curve (the real pair's on the Zen
    4 CPU: bfloat16 prepacked target, int8 draft, where 4 tokens cost what 1 does and 16 cost 1.6 times as much):
    the chain and the tree chosen for the batch shrink as it grows, down to plain batched steps."""
    from hf_specdec.plan.shape_sizing import RankAcceptance, level_cuts_menu, sub_shapes_menu
    from hf_specdec.plan.shapes import chain_parents
    from hf_specdec.plan.step_sizing import StepSizer

    sizes = (1, 4, 8, 16, 32, 64, 128)
    profile = HardwareProfile(LatencyCurve(sizes, (0.119, 0.106, 0.1425, 0.1889, 0.3254, 0.5818, 1.0937)),
                              LatencyCurve(sizes, (0.0284, 0.0337, 0.0424, 0.0629, 0.1029, 0.1932, 0.3755)))
    for menu in (level_cuts_menu(chain_parents(8)), sub_shapes_menu([4, 2, 1, 1])):
        nodes = []
        for rows in (1, 2, 4, 8, 16, 32):
            ranks = [RankAcceptance([0.8, 0.1, 0.05], menu.width)] * rows
            nodes.append(len(menu.shapes[menu.best(StepSizer(for_batch(profile, rows)), ranks)[0]]))
        assert nodes == sorted(nodes, reverse=True) and nodes[0] > 2 and nodes[-1] == 1, nodes


def test_a_batch_is_priced_by_its_slowest_row():
    """Every row drafts the same shape, and the call lasts as long as its slowest row: a batch of a sure row and an
    unsure one is priced as two unsure rows, so it drafts the shorter chain the unsure row pays for (the rows' sum
    would have drafted for the sure one)."""
    from hf_specdec.plan.shape_sizing import RankAcceptance, level_cuts_menu
    from hf_specdec.plan.shapes import chain_parents
    from hf_specdec.plan.step_sizing import StepSizer

    sizes = (1, 4, 8, 16, 32, 64, 128)
    profile = HardwareProfile(LatencyCurve(sizes, (0.119, 0.106, 0.1425, 0.1889, 0.3254, 0.5818, 1.0937)),
                              LatencyCurve(sizes, (0.0284, 0.0337, 0.0424, 0.0629, 0.1029, 0.1932, 0.3755)))
    menu = level_cuts_menu(chain_parents(8))
    sizer = StepSizer(for_batch(profile, 2))
    sure, unsure = (RankAcceptance([p, 0.0, 0.0], menu.width) for p in (0.95, 0.5))
    mixed = menu.seconds_per_token(sizer, [sure, unsure])
    assert np.allclose(mixed, menu.seconds_per_token(sizer, [unsure, unsure]))
    chosen = len(menu.shapes[menu.best(sizer, [sure, unsure])[0]])
    assert chosen < len(menu.shapes[menu.best(sizer, [sure, sure])[0]])
    summed = menu.seconds_per_step(sizer) / sum(menu.expected_tokens(row.vectors()) for row in (sure, unsure))
    assert chosen < len(menu.shapes[int(summed.argmin())])


def test_a_row_of_a_batch_prices_its_share_of_the_pass_within_the_measured_tokens():
    """Each row drafting its own tree (specexec, staged) prices a pass over n nodes per row as a `rows`-th of what
    rows * n tokens cost, and only where the curve measured rows * n tokens: on a curve flat up to 128 tokens (a GPU's)
    a row of 16 grows at most 8 nodes, where the straight line past 128 would have priced 128 nodes per row (2,048
    tokens) like 8."""
    from hf_specdec.plan.sizing import row_share
    from hf_specdec.plan.step_sizing import StepSizer

    profile = HardwareProfile(flat_until(128, 0.020), flat_until(128, 0.003))
    for rows, largest in ((1, 128), (2, 64), (3, 32), (16, 8), (128, 1), (200, 1)):
        shared = row_share(profile, rows)
        assert shared.target.sizes[-1] == largest and shared.draft == profile.draft
        assert shared.target(largest) == pytest.approx(profile.target(rows * largest) / rows)
        sizer = StepSizer(shared)
        assert sizer.max_nodes == largest
        assert sizer.best_size([0.99] * 200, 0.0)[0] == largest  # a sure draft on a flat curve: as big as it may
        assert sizer.next_frontier([0.99] * (largest - 1), [0.99] * 32, 0.0) == 0  # and no pass past it


def test_a_batch_of_best_first_rows_grows_trees_within_the_measured_pass(monkeypatch):
    """`specexec` in a batch of 4 on a curve flat up to 128 tokens, with a draft that always agrees: while the 4 rows
    decode, no row's tree passes 32 nodes (4 x 32 = 128 tokens a pass), yet the trees do grow past a chain's size;
    the output is plain batched generate's."""
    from hf_specdec.integration import generate as integration
    from hf_specdec.methods.specexec.lockstep import LockstepBestFirstDrafter

    profile = HardwareProfile(flat_until(128, 0.010), flat_until(128, 0.001))
    plan = SimpleNamespace(profile=profile, acceptance=[0.9])
    monkeypatch.setattr(integration, "plan_for_call", lambda *args, **kwargs: (plan, "curves given here"))
    sizes, propose = [], LockstepBestFirstDrafter.propose

    def seen(self, ids, prefixes, unpadded):
        trees = propose(self, ids, prefixes, unpadded)
        sizes.append((len(trees), max(len(tree) for tree in trees)))
        return trees

    monkeypatch.setattr(LockstepBestFirstDrafter, "propose", seen)
    target = tiny_model("qwen2", 0)
    ids, mask = padded_batch(4, [0, 2, 4, 1])
    call = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, **call, assistant_model=copy.deepcopy(target), speculation="specexec")
    assert torch.equal(out, target.generate(ids, **call))
    four = [largest for rows, largest in sizes if rows == 4]
    assert four and 8 < max(four) <= 32, sizes


def test_a_bigger_batch_drafts_shorter_chains_and_each_row_counts_them(monkeypatch):
    """The same chain and curves (a target pass flat up to 8 tokens, then growing; a cheap draft): two rows draft
    the whole 4-node chain (an 8-token pass), four rows one token each (a 4-node chain each would be a 16-token pass,
    twice the time, for fewer than twice the tokens); every row's stats count its shrunk steps, and the output is
    plain batched generate's."""
    target = tiny_model("qwen2", 0)
    draft = near_draft(target, noise=0.05)
    drafters = sized_batch(monkeypatch, HardwareProfile(flat_until(8, 0.010), flat_until(8, 0.001)), [0.9])
    nodes = {}  # per batch size: the shapes of the steps all its rows took
    for rows in (2, 4):
        ids, mask = padded_batch(rows, [0, 2, 4, 1][:rows])
        call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        out = target.generate(ids, **call, assistant_model=draft, speculation="chain",
                              speculation_config={"num_draft_tokens": 3, "confidence_threshold": 0},
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, target.generate(ids, **call))
        nodes[rows] = {size for active, size in drafters[-1].choices if active == rows}
        shrunk = [row.shrunk_steps for row in out.speculation_stats]
        assert all(count > 0 for count in shrunk) if rows == 4 else shrunk == [0] * rows
        assert "sized for the batch" in out.speculation_stats[0].plan_source
    assert nodes == {2: {4}, 4: {2}}


def test_a_batch_whose_draft_is_useless_falls_to_plain_batched_steps(monkeypatch):
    """A draft that proposes what the target never keeps: the rows' learned acceptance falls and the sizing runs
    plain batched steps (every row's root alone, no draft pass), probing now and then; each row's stats count its
    plain steps, and the output is plain batched generate's. (The call is priced with its slowest row at the mean
    row's acceptance, so that it speculates first: at the prior share the 40 tokens would not repay the draft.)"""
    from hf_specdec.integration import batch as batch_module

    target = tiny_model("llama", 0)
    draft = copy.deepcopy(target)
    with torch.no_grad():  # the target's least likely token, where it keeps its most likely one
        draft.lm_head.weight.neg_()
    sized_batch(monkeypatch, HardwareProfile(flat_until(128, 0.010), flat_until(128, 0.005)), [0.8])
    monkeypatch.setattr(batch_module, "SLOWEST_ROW_SHARE", 1.0)
    ids, mask = padded_batch(5, [0, 3, 1])
    call = dict(attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = target.generate(ids, **call, assistant_model=draft, speculation="chain", return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, **call))
    for row in out.speculation_stats:
        assert row.target_forwards // 2 < row.plain_steps < row.target_forwards  # speculated first, and probes


def test_a_batch_no_tree_pays_for_decodes_plainly(monkeypatch):
    """A draft pass as costly as the target's: no chain is predicted to beat plain batched steps for the batch, so
    Transformers' own loop decodes it."""
    target = tiny_model("llama", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(9, [0, 3])
    sized_batch(monkeypatch, HardwareProfile(flat_until(128, 0.010), flat_until(128, 0.010)), [0.8])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                          speculation="chain", return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert "decoded plainly" in out.speculation_stats.plan_source


@pytest.mark.parametrize("method", ["chain", "specexec"])
def test_the_batch_guard_turns_whole_steps_plain(monkeypatch, method):
    """The measured guard watches the batch's steps as a whole (a lockstep shape's, and rows drafting each their own
    tree): while it says plain, every row verifies its root alone and no draft pass runs; then the rows speculate
    again, the output plain batched generate's throughout."""
    import math

    from hf_specdec.integration import batch as batch_module
    from hf_specdec.plan.guard import PlainGuard

    monkeypatch.setattr(batch_module, "batch_guard",  # each call's own guard (none carried over), 5 plain steps first
                        lambda *args: PlainGuard(measure_plain=True, margin=math.inf, waiting=5))
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(6, [0, 2, 5])
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    # the first call for a pair on this machine times its latency curves (passes of both models): not counted below,
    # so the test reads the same whether or not an earlier test measured this pair
    target.generate(ids, **call, assistant_model=draft, speculation=method)
    passes = []  # "t" for a target pass, "d" for a draft pass, in order
    hooks = [model.register_forward_pre_hook(lambda module, args, name=name: passes.append(name))
             for model, name in ((target, "t"), (draft, "d"))]
    try:
        out = target.generate(ids, **call, assistant_model=draft, speculation=method, return_dict_in_generate=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(out.sequences, target.generate(ids, **call))
    for row in out.speculation_stats:
        assert row.tokens_per_step[:5] == [1] * 5 and row.plain_steps >= 5 and max(row.tokens_per_step) > 1
    assert out.speculation_stats[0].draft_forwards > 0
    assert passes[:6] == ["t"] * 6  # the prompt's pass, then 5 plain steps: no draft pass before the first tree


def test_a_batch_plain_step_is_one_token_per_row_for_the_guard():
    """Until a plain step is measured, the guard estimates plain decoding from a speculative step without its draft
    passes; in a batch that step is a plain batched step, one token per row."""
    from hf_specdec.plan.guard import PlainGuard

    for rows, loses in ((4, True), (1, False)):
        guard = PlainGuard(patience=2)
        for _ in range(2):  # 4 s for 4 tokens, 2 s of them drafting: plain would take 2 s for `rows` tokens
            guard.observe(4.0, 4, plain=False, draft_seconds=2.0, rows=rows)
        assert guard.plain_next() == loses


def test_a_batch_guard_measures_a_plain_step_before_it_judges_by_one():
    """`measure_plain`: after `patience` speculative steps with no plain one, one plain step is measured; from then
    on speculation is judged against it."""
    from hf_specdec.plan.guard import PlainGuard

    guard = PlainGuard(patience=2, measure_plain=True)
    for _ in range(2):  # 2 s for 4 tokens; without draft passes 2 s for 4 rows: 0.5 s a token, a win on paper
        assert not guard.plain_next(4)
        guard.observe(2.0, 4, plain=False, rows=4)
    assert guard.plain_next(4)  # measure it
    guard.observe(1.0, 4, plain=True, rows=4)  # plain batched steps: 0.25 s a token
    assert not guard.plain_next(4)
    for _ in range(2):
        guard.observe(2.0, 4, plain=False, rows=4)
    assert guard.plain_next(4) and guard.waiting > 0  # speculation loses to what was measured


def test_a_batch_guard_measures_a_plain_step_in_every_call_long_enough():
    """A row count measured in one call is measured again in the next once that call has run `patience` speculative
    steps over it (once a call): the rate calls are judged by is a running mean over calls (memory 0.7), not the
    first call's one step. A call shorter than that measures none (a plain step would cost it much of its saving)."""
    from hf_specdec.plan.guard import PlainGuard

    guard = PlainGuard(patience=2, measure_plain=True)
    for seconds in (1.0, 2.0):  # each call's plain step: 0.25, then 0.5 s a token
        guard.new_call()
        for _ in range(2):
            assert not guard.plain_next(4)
            guard.observe(2.0, 16, plain=False, rows=4)
        assert guard.plain_next(4)
        guard.observe(seconds, 4, plain=True, rows=4)
        for _ in range(3):  # measured: not again in this call
            assert not guard.plain_next(4)
            guard.observe(2.0, 16, plain=False, rows=4)
    assert guard.plain_rates[4] == pytest.approx(0.7 * 0.25 + 0.3 * 0.5)
    guard.new_call()  # a short call: one speculative step, then it ends
    assert not guard.plain_next(4)
    guard.observe(2.0, 16, plain=False, rows=4)
    guard.new_call()
    assert not guard.plain_next(4)


def test_a_batch_guard_judges_steps_against_plain_steps_over_as_many_rows():
    """Rows that finish make a plain batched step dearer per token (here 0.085 s a token over 8 rows, 0.2 over 2):
    speculative steps over 2 rows at 0.1 s a token win against 2 rows' plain rate, though they would lose against
    8 rows'; over 8 rows the same rate loses. A row count with no plain step yet is measured before it is judged."""
    from hf_specdec.plan.guard import PlainGuard

    guard = PlainGuard(patience=2, measure_plain=True, margin=1.0)
    guard.observe(0.68, 8, plain=True, rows=8)
    guard.observe(0.4, 2, plain=True, rows=2)
    for _ in range(3):
        guard.observe(1.0, 10, plain=False, rows=2)
        assert not guard.plain_next(2)
    for _ in range(2):
        guard.observe(4.0, 40, plain=False, rows=8)
    assert guard.plain_next(8) and guard.waiting > 0
    fresh = PlainGuard(patience=2, measure_plain=True, margin=1.0)
    fresh.observe(0.68, 8, plain=True, rows=8)
    for _ in range(2):
        fresh.observe(1.0, 10, plain=False, rows=5)
    assert fresh.plain_next(5) and fresh.waiting == 0  # a plain step over 5 rows, to judge by
    fresh.observe(0.5, 5, plain=True, rows=5)
    assert set(fresh.plain_rates) == {8, 5}


@pytest.mark.parametrize("method", ["chain", "specexec"])
def test_the_next_batch_call_goes_on_where_a_losing_one_left(monkeypatch, method):
    """A batch whose speculation the guard judges the loser: the next call of that batch size with the same settings
    starts with plain batched steps, without judging again; a batch of another size judges afresh."""
    import functools

    from hf_specdec.integration import batch as batch_module
    from hf_specdec.plan.guard import PlainGuard

    monkeypatch.setattr(batch_module, "BATCH_MARGIN", 0.0)  # every judgement: speculation loses
    # whole calls judged losers too, but none decoded by Transformers' loop: the steps' guard is what is tested
    monkeypatch.setattr(batch_module, "PlainGuard", functools.partial(PlainGuard, patience=2, backoff=1000,
                                                                      first_call_wait=0))
    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    three, three_mask = padded_batch(21, [0, 2, 5])
    two, two_mask = padded_batch(22, [0, 3])
    runs = [(three, three_mask), (three, three_mask), (two, two_mask)]
    outs, waits = [], []
    for ids, mask in runs:
        outs.append(target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                    assistant_model=draft, speculation=method, return_dict_in_generate=True))
        waits.append([guard.waiting for guard in remembered_guards()])
    for out, (ids, mask) in zip(outs, runs):
        assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                                          do_sample=False))
    assert waits[0] and waits[0][0] > 0  # the first call ended judging speculation the loser, mid-wait
    first, second, other = (out.speculation_stats for out in outs)
    assert any(max(row.tokens_per_step) > 1 for row in first) and all(row.plain_steps > 0 for row in first)
    assert all(row.plain_steps == len(row.tokens_per_step) for row in second)  # plain batched steps only
    assert any(max(row.tokens_per_step) > 1 for row in other)  # another batch size: judged afresh


def remembered_guards() -> list:
    """Every guard remembered so far (the suite starts each test with none)."""
    from hf_specdec.plan import guard

    return [g for drafts in guard._REMEMBERED.values() for table in [drafts[None], *drafts["by draft"].values()]
            for g in table.values()]


def test_host_reads_per_step_stay_bounded(monkeypatch):
    """The host reads what it must decide on, never more than per step the drafted tokens once for the whole batch,
    then per row its verdict and its stopping check, and where a row stops, its last block token by token (reads
    inside model passes, Transformers' own, are not counted; the setup reads the prompt and its padding once). A
    loose bound: the verdicts and stopping checks are now read once per step for all rows, which
    tests/test_round_trips.py checks (draft passes + 2 per step, whatever the batch size)."""
    from tests.roundtrips import READS

    target = tiny_model("qwen2", 0)
    draft = near_draft(target)
    ids, mask = padded_batch(4, [0, 2, 4])
    counts = {"reads": 0, "active": False, "in_model": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        def read(self, *args, **kwargs):
            counts["reads"] += counts["active"] and not counts["in_model"]
            return originals[name](self, *args, **kwargs)
        return read

    loop = batch_loop.batch_speculative_loop

    def counted(*args, **kwargs):
        counts["active"] = True
        try:
            return loop(*args, **kwargs)
        finally:
            counts["active"] = False

    hooks = [hook for model in (target, draft) for hook in (
        model.register_forward_pre_hook(lambda *_: counts.__setitem__("in_model", counts["in_model"] + 1)),
        model.register_forward_hook(lambda *_: counts.__setitem__("in_model", counts["in_model"] - 1)))]
    monkeypatch.setattr("hf_specdec.integration.batch.batch_speculative_loop", counted)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, assistant_model=draft,
                              speculation="chain", return_dict_in_generate=True)
    finally:
        for hook in hooks:
            hook.remove()
    row_steps = sum(row.target_forwards for row in out.speculation_stats)
    steps = max(row.target_forwards for row in out.speculation_stats)
    finishing = 3 * 5  # each row's last block is checked token by token where its stop fired (4 drafted + bonus)
    assert 0 < counts["reads"] <= 2 + steps + 2 * row_steps + finishing


def test_on_cuda_tree_passes_attend_without_cudnn_and_give_the_settings_back():
    """cuDNN's SDPA cost 1.45 ms of host time per masked call in a batch on an H100 and made the passes of trees whose
    sizes change 2-7x slower (core.attention): eager tree passes run without it, and the user's backend settings are
    theirs again after the call. (No GPU needed: the context only sets PyTorch's backend flags.)"""
    from hf_specdec.runtime.attention import tree_attention_kernels

    def flags() -> dict[str, bool]:
        backends = torch.backends.cuda
        return {"cudnn": backends.cudnn_sdp_enabled(), "flash": backends.flash_sdp_enabled(),
                "efficient": backends.mem_efficient_sdp_enabled(), "math": backends.math_sdp_enabled()}

    before = flags()
    with tree_attention_kernels(torch.device("cuda", 0)):
        assert flags() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    with tree_attention_kernels(torch.device("cpu")):
        assert flags() == before  # nothing changes off CUDA
    assert flags() == before


@pytest.mark.parametrize("rows", [1, 2], ids=["one sequence", "a batch"])
def test_every_eager_pass_of_a_call_runs_inside_the_tree_kernels(monkeypatch, rows):
    import contextlib

    from hf_specdec.integration import batch, generate

    inside, seen = [], []

    @contextlib.contextmanager
    def recorded(device):
        seen.append(torch.device(device))
        inside.append(True)
        yield
        inside.pop()

    monkeypatch.setattr(batch, "tree_attention_kernels", recorded)
    monkeypatch.setattr(generate, "tree_attention_kernels", recorded)
    target = tiny_model("llama", 0)
    draft = near_draft(target)
    passes = []
    hooks = [m.register_forward_pre_hook(lambda *_: passes.append(bool(inside))) for m in (target, draft)]
    ids, mask = padded_batch(3, [0, 2][:rows])
    try:
        target.generate(ids, attention_mask=mask, assistant_model=draft, speculation="chain", max_new_tokens=8,
                        do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == [torch.device("cpu")] and passes and all(passes)
