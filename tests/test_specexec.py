"""`speculation="specexec"`: best-first trees, automatic budgets, offloaded targets, bounded-memory large budgets."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_specdec import SpecExecConfig, TokenTree
from hf_specdec.methods.specexec.best_first import BestFirstDrafter, step_memory_bound
from hf_specdec.runtime.devices import is_offloaded
from hf_specdec_tools.bench.measure import PeakMemory
from tests.conftest import random_prompt, tiny_model


def test_best_first_tree_holds_the_most_probable_nodes():
    """Every kept node is at least as probable (cumulative draft log-probability) as every node left out."""
    draft = tiny_model("llama", 1)
    drafter = BestFirstDrafter(draft, budget=24, max_depth=5, width=3, beams=4)
    ids = random_prompt(torch.Generator().manual_seed(0), 6)
    tree = drafter.propose(ids)
    assert isinstance(tree, TokenTree) and 1 < len(tree) <= 24 and tree.max_depth <= 5
    logp = torch.zeros(len(tree))
    with torch.no_grad():
        for node in range(1, len(tree)):
            path = tree.path_to(node)
            seq = torch.cat([ids[0], tree.tokens[path[1:]]])[None]
            parent_logits = draft(seq[:, :-1]).logits[0, -1].log_softmax(-1)
            logp[node] = logp[tree.parents[node]] + parent_logits[tree.tokens[node]]
    # Siblings come most probable first, and children are never more probable than their parent.
    for node in range(1, len(tree)):
        assert logp[node] <= logp[tree.parents[node]] + 1e-5
    # The best node left out (a top-width child of a kept node, not in the tree) is no better than the worst kept.
    worst_kept = logp[1:].min()
    with torch.no_grad():
        for node in range(len(tree)):
            if tree.depths[node] >= 5:
                continue
            seq = torch.cat([ids[0], tree.tokens[tree.path_to(node)[1:]]])[None]
            top = draft(seq).logits[0, -1].log_softmax(-1).topk(3)
            kids = set(tree.tokens[tree.children(node)].tolist())
            for value, token in zip(top.values, top.indices):
                if int(token) not in kids:
                    assert logp[node] + value <= worst_kept + 1e-5


def test_default_sizes_trees_every_step_from_the_latency_curve(monkeypatch):
    """No budget: lossless, says where its latency curves came from, and grows deeper trees for a draft the target
    agrees with (the target itself) than for an unrelated one. The curves are given (a 10 ms target pass, a 1 ms
    draft pass, flat up to 128 tokens) and kept uncorrected: measured ones follow the machine's load, and under load
    every step of both drafts may rightly turn plain."""
    from hf_specdec.integration import generate as integration
    from hf_specdec.methods import step_sized
    from hf_specdec.plan.sizing import HardwareProfile
    from hf_specdec.plan.step_sizing import StepSizer, learned_acceptance, processors_key
    from tests.helpers.batches import flat_until

    plan = SimpleNamespace(profile=HardwareProfile(flat_until(128, 0.010), flat_until(128, 0.001)), acceptance=[0.9])
    monkeypatch.setattr(integration, "plan_for_call", lambda *args, **kwargs: (plan, "curves given here"))
    monkeypatch.setattr(step_sized, "online_sizer", lambda profile, target, draft, processors: StepSizer(
        profile, learned_acceptance(draft, (id(target), processors_key(processors))), timing_memory=1.0))
    target, draft = tiny_model("qwen2", 0), tiny_model("qwen2", 1)
    ids = random_prompt(torch.Generator().manual_seed(1), 6)
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    sizes = {}
    for name, assistant in (("unrelated", draft), ("same", copy.deepcopy(target))):
        out = target.generate(ids, assistant_model=assistant, speculation="specexec", max_new_tokens=20,
                              do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.speculation_stats.plan_source.startswith("trees sized every step with the latency curves of ")
        stats = out.speculation_stats
        sizes[name] = (stats.drafted_tokens / stats.target_forwards, stats.mean_tokens_per_step)
    assert sizes["same"][1] > sizes["unrelated"][1]
    assert sizes["same"][0] > 1.0


@pytest.fixture(params=["most-layers-on-disk", "all-on-disk"])
def offloaded_target(request, tmp_path):
    """A 6-layer tiny Llama saved and reloaded with accelerate, most of its layers on disk, or all of them (then
    `model.device` is `meta` and inputs must go to accelerate's execution device instead)."""
    model = tiny_model("llama", 0, num_hidden_layers=6)
    model.save_pretrained(tmp_path / "target")
    placement = (
        {"device_map": "auto", "max_memory": {"cpu": 120_000}}
        if request.param == "most-layers-on-disk"
        else {"device_map": {"": "disk"}}
    )
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "target", offload_folder=str(tmp_path / "offload"), **placement
    ).eval()
    offloaded.generation_config.pad_token_id = 0
    return model, offloaded


def test_offloaded_target_is_lossless_and_sized_for_offloading(offloaded_target, monkeypatch):
    """The automatic budget measures an offloaded profile; the per-step sizing is then given an offloaded target's
    costs (a 50 ms pass, flat to 2048 tokens, against a 0.5 ms draft pass, kept uncorrected): this tiny target's disk
    reads cost little more than its copy in memory, and measured on a loaded machine the curves may rightly size
    shallow trees (CI once saw 11 target passes for 20 tokens)."""
    import dataclasses

    from hf_specdec.methods import step_sized
    from hf_specdec.plan.step_sizing import StepSizer, learned_acceptance, processors_key
    from tests.helpers.batches import flat_until

    def offloading_costs(profile, target, draft, processors):
        assert profile.placement["offloaded"]  # what the automatic budget measured
        sizes = (1, 16, 64, 256, 1024, 2048)
        given = dataclasses.replace(profile, target=flat_until(2048, 0.050, sizes), draft=flat_until(128, 0.0005),
                                    step_overhead=0.0)
        return StepSizer(given, learned_acceptance(draft, (id(target), processors_key(processors))),
                         timing_memory=1.0)

    monkeypatch.setattr(step_sized, "online_sizer", offloading_costs)
    model, offloaded = offloaded_target
    assert is_offloaded(offloaded) and not is_offloaded(model)
    assert "disk" in set(offloaded.hf_device_map.values())
    draft = copy.deepcopy(model)
    ids = random_prompt(torch.Generator().manual_seed(2), 6)
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(offloaded.generate(ids, max_new_tokens=20, do_sample=False), expected)
    for config in (SpecExecConfig(budget=32, max_depth=6, width=4), "specexec"):
        out = offloaded.generate(ids, assistant_model=draft, speculation=config, max_new_tokens=20, do_sample=False,
                                 return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.speculation_stats.target_forwards <= 20 // 2  # the draft is the target: several tokens per pass
    assert "offloaded" in out.speculation_stats.plan_source  # the automatic budget used an offloaded profile


def test_budget_2048_runs_within_its_stated_memory_bound():
    target, draft = tiny_model("llama", 0), tiny_model("llama", 1)
    ids = random_prompt(torch.Generator().manual_seed(3), 8)
    expected = target.generate(ids, max_new_tokens=6, do_sample=False)
    config = SpecExecConfig(budget=2048, max_depth=12, width=16, beams=256)
    bound = step_memory_bound(2048, 256, 16, vocab=64, past_length=ids.shape[1] + 6, num_heads=4, dtype_bytes=4)
    with PeakMemory() as memory:
        out = target.generate(ids, assistant_model=draft, speculation=config, max_new_tokens=6, do_sample=False,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.drafted_tokens >= 2047  # the trees really filled the budget
    # Twice the bound leaves room for temporaries and allocator slack; a quadratic blow-up would exceed it many times.
    assert memory.delta <= 2 * bound, (memory.delta, bound)
