"""`speculation="sequoia"`: hardware-aware sizing, teacher-forced acceptance, plan files and lookup, calibration.

Planner optimality itself is tested in test_planning.py; here the pieces around it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest
import torch

import hf_specdec
from hf_specdec.methods.sequoia import (
    SequoiaPlan,
    calibrate,
    expected_tokens,
    find_plan,
    plan_tree,
    rank_acceptance,
    store,
)
from hf_specdec.methods.sequoia.acceptance import _simulate_residual
from hf_specdec.methods.sequoia.calibrate import alternative_sizes, evaluate_plan
from hf_specdec.methods.sequoia.sizing import choose_plan
from hf_specdec.plan.latency import LatencyCurve, measure_latency
from hf_specdec.plan.sizing import HardwareProfile, level_widths_with_children, step_seconds
from hf_specdec.verify import SequoiaVerifier, SpecInferVerifier
from hf_specdec_tools.cli import main as cli_main
from hf_specdec_tools.plots import plot_all
from tests.conftest import random_prompt, tiny_model
from tests.helpers.exactness import Case, all_runs, draft_trees, to_token_tree
from tests.tiny import tiny_tokenizer


@pytest.fixture(autouse=True)
def plan_store(tmp_path, monkeypatch):
    """Each test starts with an empty plan store of its own."""
    folder = tmp_path / "plans"
    monkeypatch.setattr(store, "user_plan_dir", lambda: folder)
    return folder


def curve(fn, sizes=(1, 2, 4, 8, 16, 32, 64, 128)) -> LatencyCurve:
    return LatencyCurve(tuple(sizes), tuple(float(fn(n)) for n in sizes))


# ---------------------------------------------------------------- latency curves and sizing


def test_latency_curve_interpolates_and_extrapolates():
    c = LatencyCurve((1, 4, 8), (0.1, 0.1, 0.3))
    assert c(1) == pytest.approx(0.1) and c(6) == pytest.approx(0.2) and c(16) == pytest.approx(0.7)
    assert LatencyCurve.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="increasing"):
        LatencyCurve((4, 1), (0.1, 0.2))


def test_a_noisy_bump_in_a_latency_curve_is_flattened():
    """Measured on an offloaded target here: 16 tokens took 6.2 s, 64 took 5.6 s (a page-fault burst)."""
    c = LatencyCurve((1, 16, 64, 256), (2.15, 6.2, 5.6, 8.6))
    assert c(16) == pytest.approx(5.6) and c(40) == pytest.approx(5.6) and c(1) == pytest.approx(2.15)
    assert c(160) == pytest.approx(7.1) and c.seconds == (2.15, 6.2, 5.6, 8.6)  # the raw measurement is kept
    assert all(a <= b for a, b in zip(c(np.arange(1, 300)), c(np.arange(2, 301))))


def test_measure_latency_on_a_tiny_model():
    model = tiny_model("qwen2", 0)
    measured = measure_latency(model, sizes=(1, 3, 8), past_length=16, repeats=1, progress=False, stop_ratio=None)
    assert measured.sizes == (1, 3, 8) and all(s > 0 for s in measured.seconds)
    # Sizes stop once a pass costs more than stop_ratio times the first (here: at once), and the curve extrapolates.
    cut = measure_latency(model, sizes=(1, 3, 8), past_length=16, repeats=1, progress=False, stop_ratio=0.0)
    assert cut.sizes == (1, 3) and cut(8) >= cut(3) > 0
    # A first timing above `give_up`'s bound ends the measurement: the sizes timed so far, that one included.
    given_up = measure_latency(model, sizes=(1, 3, 8), past_length=16, repeats=3, progress=False, stop_ratio=None,
                               give_up={1: 1e3, 3: 0.0})
    assert given_up.sizes == (1, 3)
    kept = measure_latency(model, sizes=(1, 3, 8), past_length=16, repeats=1, progress=False, stop_ratio=None,
                           give_up={1: 1e3, 3: 1e3, 8: 1e3})
    assert kept.sizes == (1, 3, 8)


def test_level_widths_count_only_nodes_with_children():
    #      0
    #    1   2
    #   3 4   (2 is a leaf)
    #   5
    assert level_widths_with_children([-1, 0, 0, 1, 1, 3]) == [1, 1, 1]
    assert level_widths_with_children([-1]) == []
    assert level_widths_with_children([-1, 0, 0, 0, 1, 2, 3]) == [1, 3]


def test_step_seconds_adds_one_draft_pass_per_level():
    profile = HardwareProfile(target=curve(lambda n: 1.0 + n), draft=curve(lambda n: 10.0 * n), step_overhead=0.5)
    parents = [-1, 0, 0, 1, 1, 3]  # levels with children: 1, 1, 1 nodes
    # root pass feeds 2 tokens (20), then 10 + 10; target over 6 nodes: 7; overhead 0.5
    assert step_seconds(parents, profile) == pytest.approx(20 + 10 + 10 + 7 + 0.5)


@pytest.mark.parametrize(
    "target_fn, draft_fn",
    [
        (lambda n: 0.17 + 0.004 * n, lambda n: 0.03 + 0.001 * n),  # a CPU-like curve: cheap draft
        (lambda n: 2.0 + 0.001 * n, lambda n: 0.05),  # offloaded target: flat and expensive
        (lambda n: 0.1 * n, lambda n: 0.2),  # expensive draft, linear target
    ],
)
def test_choose_plan_minimises_predicted_time_per_token(target_fn, draft_fn):
    acceptance = [0.62, 0.12, 0.05, 0.03, 0.02]
    profile = HardwareProfile(target=curve(target_fn), draft=curve(draft_fn))
    sized = choose_plan(acceptance, profile, max_budget=48, max_depth=8)
    # Independent search: plan every (n, d) from scratch and evaluate it.
    best = min(
        step_seconds(plan.parents, profile) / plan.expected_tokens
        for n in range(1, 49)
        for d in range(1, 9)
        for plan in [plan_tree(acceptance, n, d)]
    )
    assert sized.seconds_per_token == pytest.approx(best, rel=1e-9)
    assert expected_tokens(sized.plan.parents, acceptance) == pytest.approx(sized.plan.expected_tokens)


def test_sizing_follows_the_hardware():
    acceptance = [0.7, 0.1, 0.05, 0.03]
    flat = choose_plan(acceptance, HardwareProfile(curve(lambda n: 2.0), curve(lambda n: 0.01)), 64, 10)
    costly_draft = choose_plan(acceptance, HardwareProfile(curve(lambda n: 0.2 + 0.005 * n), curve(lambda n: 0.5)),
                               64, 10)
    assert len(flat.plan.parents) == 64  # target cost does not grow: spend the whole budget
    assert len(costly_draft.plan.widths_per_level()) < len(flat.plan.widths_per_level())  # each level costs a pass


# ---------------------------------------------------------------- teacher-forced acceptance


def test_rank_acceptance_greedy_and_target_sample_are_exact():
    target = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, 1.0, 2.0, -1.0], [0.0, 1.0, 0.5, 5.0]])
    greedy = rank_acceptance(target, draft, width=3, verifier="greedy")
    assert greedy.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]  # row 0: draft ranks 2, 1, 0; target picks 1
    sampled = rank_acceptance(target, draft, width=2, verifier="target_sample")
    p = target.double().softmax(-1)
    torch.testing.assert_close(sampled[0], torch.stack([p[0, 2], p[0, 1]]))
    with pytest.raises(ValueError, match="verifier"):
        rank_acceptance(target, draft, 2, "nope")


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, SpecInferVerifier])
def test_simulated_residual_acceptance_matches_exact_enumeration(verifier_cls):
    """P(the k-th child of a star tree is accepted), enumerated exactly through the real verifier, vs the estimate."""
    case = Case(seed=3, vocab=5, banned=0.2)
    width = 3
    exact = [0.0] * width
    for tree_prob, nested in draft_trees(case, case.prompt, [[]] * width, verifier_cls.child_selection):
        tree, scores = to_token_tree(case, nested)
        for run_prob, verdict in all_runs(lambda src, t=tree, s=scores: verifier_cls().verify(t, s, source=src)):
            if verdict.accepted_ranks:
                exact[verdict.accepted_ranks[0]] += tree_prob * run_prob
    p = case.target_scores(case.prompt).double().softmax(-1)
    q = case.draft_q(case.prompt).double()
    estimate = _simulate_residual(p, q / q.sum(), width, 40000, verifier_cls is SequoiaVerifier,
                                  torch.Generator().manual_seed(0))
    torch.testing.assert_close(estimate, torch.tensor(exact, dtype=torch.float64), atol=0.01, rtol=0)


# ---------------------------------------------------------------- plan files, lookup, the method


def _plan(llama_pair, temperature=0.0, **kwargs) -> SequoiaPlan:
    target, draft = llama_pair
    prompts = [random_prompt(torch.Generator().manual_seed(i), 6)[0] for i in range(2)]
    return calibrate(target, draft, prompts, temperature=temperature, width=4, max_new_tokens=12, max_budget=16,
                     max_depth=5, latency_sizes=(1, 4, 16), progress=False, **kwargs)


def test_calibrate_writes_a_complete_json_plan(llama_pair, tmp_path):
    plan = _plan(llama_pair)
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())  # JSON, never pickle
    assert data["tree"]["parents"] == plan.parents and data["verifier"] == "greedy"
    assert data["profile"]["target"]["sizes"] == [1, 4, 16] and data["profile"]["placement"]["dtype"] == "float32"
    assert data["profile"]["placement"]["hardware"].endswith(f"({torch.backends.cpu.get_cpu_capability()})")
    assert data["target"]["fingerprint"]["model_type"] == "llama" and data["environment"]["torch"] == torch.__version__
    assert SequoiaPlan.load(path).to_dict() == plan.to_dict()
    assert data["predicted"]["tokens_per_step"] == pytest.approx(plan.tree.expected_tokens)
    with pytest.raises(ValueError, match="not a valid Sequoia plan"):
        (tmp_path / "bad.json").write_text(json.dumps({"format": 1}))
        SequoiaPlan.load(tmp_path / "bad.json")


def test_find_plan_matches_pair_and_temperature(llama_pair, plan_store):
    target, draft = llama_pair
    assert find_plan(target, draft, 0.0) is None
    greedy, warm = _plan(llama_pair), _plan(llama_pair, temperature=0.7)
    store.save_user_plan(greedy, target, draft)
    store.save_user_plan(warm, target, draft)
    assert find_plan(target, draft, 0.0)[0].temperature == 0.0
    assert find_plan(target, draft, 0.8)[0].temperature == pytest.approx(0.7)
    assert find_plan(target, draft, 1.5) is None  # too far from any calibrated temperature
    other = tiny_model("qwen2", 0)
    assert find_plan(other, draft, 0.0) is None  # another architecture


def test_sequoia_with_an_explicit_plan_is_lossless(llama_pair, tmp_path):
    target, draft = llama_pair
    plan = _plan(llama_pair)
    # Tiny models cost the same per pass, so sizing picks the root alone; this test wants a real tree.
    plan = dataclasses.replace(plan, tree=plan_tree(plan.acceptance, budget=8, max_depth=4))
    assert len(plan.parents) == 8
    path = plan.save(tmp_path / "plan.json")
    ids = random_prompt(torch.Generator().manual_seed(11), 7)
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)
    for given in (str(path), plan, plan.to_dict(), plan.tree, plan.tree.to_dict()):
        out = target.generate(ids, assistant_model=draft, speculation="sequoia", speculation_config={"plan": given},
                              max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.speculation_stats.plan_source in (f"plan file {path}", "the plan given")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_root_only_plan_decodes_exactly_as_plain_generate(dtype):
    """When no tree pays on the hardware the plan is the root alone: generate runs Transformers' own loop, so even
    in bfloat16 (where a tree pass and a plain pass round differently) sequences, scores and the stream match."""
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target, draft = tiny_model("qwen2", 0).to(dtype), tiny_model("qwen2", 1).to(dtype)
    ids = random_prompt(torch.Generator().manual_seed(13), 9)
    root_only = {"parents": [-1], "expected_tokens": 1.0, "acceptance": [0.5], "budget": 1, "max_depth": 1}
    common = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    expected = target.generate(ids, **common)
    streamer = Collect()
    out = target.generate(ids, assistant_model=draft, speculation="sequoia", speculation_config={"plan": root_only},
                          streamer=streamer, **common)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores, strict=True))
    assert sum(streamer.chunks, []) == out.sequences[0].tolist() and streamer.ended
    stats = out.speculation_stats
    assert "decoded plainly" in stats.plan_source and stats.target_forwards == stats.new_tokens == 12
    plain_ids = target.generate(ids, assistant_model=draft, speculation="sequoia", max_new_tokens=12,
                                speculation_config={"plan": root_only}, do_sample=False)
    assert torch.equal(plain_ids, expected.sequences)  # without return_dict_in_generate: the bare tensor


def test_sequoia_calibrates_online_once_then_finds_its_plan(plan_store):
    target = tiny_model("qwen2", 0)
    ids = random_prompt(torch.Generator().manual_seed(12), 6)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    with pytest.raises(ValueError, match="No Sequoia plan"):
        target.generate(ids, assistant_model=target, speculation="sequoia",
                        speculation_config={"calibrate_online": False}, max_new_tokens=4)
    assert not plan_store.exists() or not list(plan_store.iterdir())  # the refusal left nothing behind
    first = target.generate(ids, assistant_model=target, speculation="sequoia", max_new_tokens=24, do_sample=False,
                            return_dict_in_generate=True)
    assert first.speculation_stats.plan_source.startswith("online calibration")
    assert len(list(plan_store.glob("*.json"))) == 1
    second = target.generate(ids, assistant_model=target, speculation="sequoia", max_new_tokens=24, do_sample=False,
                             return_dict_in_generate=True)
    assert second.speculation_stats.plan_source.startswith("saved plan")
    for out in (first, second):
        assert torch.equal(out.sequences, expected)
    # The draft is the target: its first choice is always right, but a draft pass costs a target pass, so sizing
    # (rightly) finds no tree faster than the root alone. The saved plan records both facts.
    (saved,) = plan_store.glob("*.json")
    plan = SequoiaPlan.load(saved)
    assert plan.acceptance[0] == pytest.approx(1.0) and plan.source == "online calibration"


def test_evaluate_and_plots(llama_pair, tmp_path):
    target, draft = llama_pair
    plan = _plan(llama_pair)
    held_out = [random_prompt(torch.Generator().manual_seed(20), 5)[0]]
    plan.measured = evaluate_plan(plan, target, draft, held_out, max_new_tokens=10, progress=False)
    rows = plan.measured["trees"]
    assert rows[0]["nodes"] == len(plan.parents)
    assert all(r["measured_seconds_per_token"] > 0 and r["measured_tokens_per_step"] >= 1 for r in rows)
    paths = plot_all(plan, tmp_path / "plots")
    names = {p.name for p in paths}
    assert names == {"acceptance.png", "expected_tokens.png", "tree.png", "latency.png", "time_per_token.png"}
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_held_out_check_skips_trees_predicted_far_slower(llama_pair):
    plan = _plan(llama_pair)
    chosen = plan.predicted["seconds_per_token"]
    picks = alternative_sizes(plan, budgets=(4, 8, 16), slack=2.0)
    assert picks[0] == (plan.tree.budget, plan.tree.max_depth)
    for budget, depth in picks[1:]:
        (row,) = [c for c in plan.candidates if (c["budget"], c["max_depth"]) == (budget, depth)]
        assert row["seconds_per_token"] <= 2.0 * chosen
    assert alternative_sizes(plan, budgets=(4, 8, 16), slack=0.0) == picks[:1]  # nothing is predicted faster


def test_calibrate_command_end_to_end(tmp_path, plan_store, capsys):
    target, draft = tiny_model("llama", 0), tiny_model("llama", 0)
    tokenizer = tiny_tokenizer()
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w7 w8 w9\nw10 w11 w12 w13\nw20 w21\n")
    code = cli_main([
        "calibrate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--dtype", "float32",
        "--prompts", str(prompts), "--held-out", "1", "--width", "4", "--max-new-tokens", "8", "--max-budget", "12",
        "--max-depth", "6", "--output", str(tmp_path / "plan.json"), "--save", "--quiet",
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "plan written to" in out and "measured on 1 held-out prompt" in out
    plan = SequoiaPlan.load(tmp_path / "plan.json")
    assert plan.acceptance[0] == pytest.approx(1.0)  # identical models: the first draft choice always wins
    assert len(list(plan_store.glob("*.json"))) == 1
    assert (tmp_path / "plots" / "tree.png").is_file()
    assert cli_main(["calibrate", "--prompts", str(prompts), "--held-out", "5", "--output", "x.json"]) == 2
    assert "leave none to calibrate on" in capsys.readouterr().err


def test_sequoia_sampling_uses_the_sequoia_verifier(llama_pair):
    target, draft = llama_pair
    plan = _plan(llama_pair, temperature=0.9)
    ids = random_prompt(torch.Generator().manual_seed(13), 6)
    torch.manual_seed(0)
    out = target.generate(ids, assistant_model=draft, speculation="sequoia", speculation_config={"plan": plan},
                          do_sample=True, temperature=0.9, max_new_tokens=12, return_dict_in_generate=True)
    assert out.speculation_stats.verifier == "sequoia" and out.speculation_stats.new_tokens == 12
    assert math.isfinite(plan.predicted["seconds_per_token"])


def test_registered():
    assert hf_specdec.SPECULATION_METHODS["sequoia"].__name__ == "SequoiaConfig"


def test_a_plan_from_other_hardware_lends_its_acceptance_and_is_resized(llama_pair, plan_store, tmp_path):
    target, draft = llama_pair
    plan = _plan(llama_pair)
    foreign = SequoiaPlan.from_dict({**plan.to_dict(), "profile": {
        **plan.profile.to_dict(), "placement": {**plan.profile.placement, "hardware": "some other CPU (AVX512)"}}})
    assert foreign.same_pair(target, draft) and not foreign.runs_here(target, draft)
    foreign.save(plan_store / "foreign.json")
    ids = random_prompt(torch.Generator().manual_seed(14), 6)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, assistant_model=draft, speculation="sequoia", max_new_tokens=16, do_sample=False,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.plan_source.startswith("acceptance from saved plan foreign.json, latency measured now")
    (resized_path,) = [p for p in plan_store.glob("*.json") if p.name != "foreign.json"]
    resized = SequoiaPlan.load(resized_path)
    assert resized.runs_here(target, draft) and resized.acceptance == foreign.acceptance
    again = target.generate(ids, assistant_model=draft, speculation="sequoia", max_new_tokens=16, do_sample=False,
                            return_dict_in_generate=True)
    assert again.speculation_stats.plan_source.startswith(f"saved plan {resized_path.name}")


def test_a_slow_spell_of_the_machine_does_not_price_one_size(monkeypatch):
    # Three passes in a row run slow (a busy neighbour) while the curve is measured: timed size after size, they
    # were the three timings of size 3 (the prefill, then a warm-up and 3 timings per size: passes 6-8), whose
    # median then read the spell. In rounds over the sizes each size sees at most one of them.
    model = tiny_model("qwen2", 0)
    forward, calls, spell = model.forward, [0], 0.2

    def busy_forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 in (6, 7, 8):
            time.sleep(spell)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", busy_forward)
    curve = measure_latency(model, sizes=(1, 3, 8), past_length=16, repeats=3, progress=False, stop_ratio=None)
    assert calls[0] == 1 + 3 * 4  # the prefill, then a warm-up and 3 timings per size: the spell fell inside
    assert curve.sizes == (1, 3, 8) and max(curve.seconds) < spell / 2, curve.seconds
