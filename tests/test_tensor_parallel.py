"""A target sharded by Transformers' tensor parallelism over 2 ranks (gloo on CPU, launched with torchrun): every
method at its defaults, greedy and sampled, returns the same tokens on both ranks, greedy equal to the unsharded
model, and sampled too where the tree's shape depends on no clock (chain, tree, prompt lookup); the processes exit
cleanly. Plus the pieces that need no second process: who agrees with whom, and how a
sharded or device-mapped target's plans are named apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_specdec.core.tree import TokenTree
from hf_specdec.methods.sequoia import store
from hf_specdec.plan.latency import placement
from hf_specdec.runtime import ranks as ranks_module
from hf_specdec.runtime.devices import PassClock, compute_devices, device_layout
from hf_specdec.runtime.ranks import ONE_PROCESS, Ranks, sharding_mesh

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker  # noqa: E402

LAUNCHES = 2  # fresh processes and plan folders: the failures this guards against were intermittent


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tp-target")
    tp_worker.make_target(folder)
    return folder


@pytest.mark.slow  # about 20 s a launch on 2 cores: two processes load torch, Transformers and the models
@pytest.mark.parametrize("launch", range(LAUNCHES))
def test_two_ranks_agree_and_equal_the_unsharded_model(saved_target, tmp_path, launch):
    run = tmp_path / "model"
    run.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (run / name).write_bytes((saved_target / name).read_bytes())
    env = {**os.environ, "HF_SPECDEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    # --standalone: the launcher's store binds a port of its own (a port picked here could be taken before use)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(tp_worker.__file__)), str(run)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]  # a clean exit on both ranks: no abort, no lost peer
    first, second = (json.loads((run / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert any("-tp2-" in name for name in first.pop("plans"))  # the sharded target's plans, named apart
    second.pop("plans")
    for method in tp_worker.FIXED_SHAPES:  # the same draws as the unsharded model's, from the same seeds
        assert first.pop(f"unsharded {method}/sampled") == first[f"{method}/sampled"], method
        second.pop(f"unsharded {method}/sampled")
    assert set(first) == {"plain", "unsharded-own-prompt", "sharded-plain", "refused", "round-trips",
                          *(f"{m}/{mode}" for m in tp_worker.METHODS for mode in ("greedy", "sampled"))}
    plain = first["plain"][0]
    assert first["unsharded-own-prompt"] == second["unsharded-own-prompt"] == [True]  # each rank's own prompt
    sharded, unsharded = first.pop("round-trips")
    assert sharded == unsharded and sharded[1] > 0, f"deciding rank: {sharded}, unsharded: {unsharded} (reads, steps)"
    assert second.pop("round-trips")[0][1] == sharded[1]  # the other rank ran the same steps (and drafted nothing)
    for key in first:
        assert first[key] == second[key], f"{key}: the ranks returned different tokens"
        if key.endswith("greedy") or key in ("plain", "sharded-plain"):
            assert all(tokens == plain for tokens in first[key]), f"{key}: not the unsharded model's tokens"
        if key.endswith("sampled"):
            runs = first[key]
            assert all(len(tokens) == len(plain) and tokens[: len(tp_worker.PROMPT)] == tp_worker.PROMPT
                       for tokens in runs)
    assert first["refused"].startswith("No Sequoia plan"), first["refused"]


@pytest.fixture
def one_rank_world(tmp_path):
    """torch.distributed initialised with one gloo rank, as a data-parallel program would have it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_an_unsharded_model_decides_alone_even_under_torch_distributed(tiny_pair, one_rank_world):
    target, _ = tiny_pair
    assert sharding_mesh(target) is None
    assert Ranks.of(target) is ONE_PROCESS
    assert device_layout(target) is None
    tree = TokenTree.from_parents(torch.tensor([3, 4, 5]), [-1, 0, 0])
    assert ONE_PROCESS.tree(tree, torch.device("cpu")) is tree and ONE_PROCESS.decided("x") == "x"


def test_a_device_map_over_several_places_names_its_plans_apart(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    alone = (store.plan_filename(target, draft, 0.0), placement(target))
    layers = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "lm_head": "cpu"}
    monkeypatch.setattr(target, "hf_device_map", layers, raising=False)
    spread = device_layout(target)
    assert spread is not None and spread.startswith("map-")
    assert store.plan_filename(target, draft, 0.0) != alone[0] and placement(target)["layout"] == spread
    assert "layout" not in alone[1]
    monkeypatch.setattr(target, "hf_device_map", {**layers, "model.layers.1": "cpu", "model.layers.0": "disk"})
    assert device_layout(target) != spread  # another map is another layout
    assert compute_devices(target) == [torch.device("cpu")]  # disk-offloaded layers compute where the hook runs


def test_pass_clock_over_several_cpu_devices_keeps_wall_time():
    clock = PassClock([torch.device("cpu"), torch.device("cpu")])
    clock.start()
    torch.ones(64, 64) @ torch.ones(64, 64)
    clock.stop()
    assert clock.total > 0


def test_ranks_on_another_backend_talk_on_a_gloo_group_of_their_own(one_rank_world, monkeypatch):
    """Tensor parallelism on GPUs runs on NCCL, which broadcasts device tensors only: the tree and verdict travel on
    a gloo group of the same ranks instead, so that no rank reads them back from a device."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(ranks_module, "_HOST_GROUPS", {})
    host = ranks_module._host_group(dist.group.WORLD, (0,))
    assert host is not dist.group.WORLD and ranks_module._host_group(dist.group.WORLD, (0,)) is host  # made once
    monkeypatch.undo()
    assert dist.get_backend(host) == "gloo"
    ranks = Ranks(host, 0, True)
    tree = TokenTree.from_parents(torch.tensor([3, 4, 5, 6]), [-1, 0, 0, 1])
    assert ranks.tree(tree, torch.device("cpu")) is tree and ranks.decided({"a": 1}) == {"a": 1}
