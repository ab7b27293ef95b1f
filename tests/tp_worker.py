"""One rank of a tensor-parallel run: a tiny Llama target sharded by Transformers over the ranks (gloo, CPU), a
noisy copy of it as the draft, whole on every rank. Run by `tests/test_tensor_parallel.py` (two processes) or by hand:

    torchrun --nproc_per_node 2 tests/tp_worker.py <folder> [method ...]

`<folder>` holds the saved target (`make_target`); each rank writes `rank<r>.json`: per method and mode, the tokens
every repeat returned, plain greedy `generate` of the unsharded target for comparison, and a few checks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from roundtrips import count_round_trips  # beside this file
from tiny import tiny_model  # beside this file
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.methods.sequoia import store

METHODS = ("chain", "tree", "sequoia", "specexec", "staged", "prompt_lookup")
FIXED_SHAPES = ("chain", "tree", "prompt_lookup")  # trees shaped by settings alone, not by a clock or a plan
PROMPT = [5, 17, 9, 33, 5, 17, 9, 40, 12, 5, 17]  # repeats, so prompt lookup finds matches too
NEW_TOKENS = 24
REPEATS = 2


def make_target(folder: Path) -> None:
    """Save a tiny random Llama whose heads split over 2 ranks, its output sharpened so drafts are often right."""
    tiny_model("llama", 0, max_position_embeddings=256).save_pretrained(folder)


def noisy_copy(folder: Path) -> torch.nn.Module:
    """The target's weights plus seeded noise: the same draft on every rank, often but not always right."""
    draft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return draft


def decode(target: torch.nn.Module, draft: torch.nn.Module, ids: torch.Tensor, method: str, mode: str, repeat: int
           ) -> list[int]:
    """One `generate` call of `method`, greedy or sampled from the seeds of this repeat."""
    sampling = {"do_sample": True, "temperature": 0.8} if mode == "sampled" else {"do_sample": False}
    generator = torch.Generator().manual_seed(100 + repeat) if mode == "sampled" else None
    torch.manual_seed(200 + repeat)
    helper = {} if method == "prompt_lookup" else {"assistant_model": draft}  # prompt lookup drafts from the prompt
    # fixed shapes are compared draw for draw with the unsharded model: the timing-driven guard and tree's and chain's
    # per-step sizing stay off for them (both follow each run's own clock); the other methods run at their defaults
    fixed = {"guard": False, **({"per_step": False} if method in ("tree", "chain") else {})}
    settings = {"speculation_config": fixed} if method in FIXED_SHAPES else {}
    out = target.generate(ids, speculation=method, max_new_tokens=NEW_TOKENS, speculation_generator=generator,
                          **helper, **sampling, **settings)
    return out[0].tolist()


def counted_reads(target: torch.nn.Module, draft: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """(host reads, target passes) of one specexec call with a fixed budget (as in tests/test_round_trips.py), the
    measured guard off: its timing-driven plain steps would make the two calls' step counts differ."""
    with count_round_trips(target, draft) as trips:
        target.generate(ids, assistant_model=draft, speculation="specexec",
                        speculation_config={"budget": 16, "guard": False}, max_new_tokens=NEW_TOKENS)
    return [trips.reads, trips.target_passes]


def main(folder: Path, methods: list[str]) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if os.environ.get("TP_WORKER_OWN_CACHE"):  # a plan folder per rank, as ranks on different nodes would have
        os.environ["HF_SPECDEC_CACHE"] = os.path.join(os.environ["HF_SPECDEC_CACHE"], f"rank{rank}")
    dist.init_process_group("gloo")
    target = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=dist.get_world_size())
    ).eval()
    draft = noisy_copy(folder)
    ids = torch.tensor([PROMPT])
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # not sharded
    results: dict = {"plain": [whole.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()]}
    # Data-parallel use: an unsharded model decodes a different prompt on each rank, with no agreement between them
    # (specexec sizes its trees by each rank's own clock): each rank must equal plain generate on its own prompt.
    own = torch.tensor([PROMPT[rank:]])
    results["unsharded-own-prompt"] = [
        whole.generate(own, assistant_model=draft, speculation="specexec", max_new_tokens=NEW_TOKENS)[0].tolist()
        == whole.generate(own, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    ]
    unsharded_reads = counted_reads(whole, draft, ids)
    # Methods whose trees do not depend on a clock draw the same samples unsharded, from the same seeds
    for method in FIXED_SHAPES:
        results[f"unsharded {method}/sampled"] = [decode(whole, draft, ids, method, "sampled", repeat)
                                                  for repeat in range(REPEATS)]
    del whole
    results["sharded-plain"] = [target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()]
    for method in methods:
        for mode in ("greedy", "sampled"):
            results[f"{method}/{mode}"] = [decode(target, draft, ids, method, mode, r) for r in range(REPEATS)]
    # Host reads on the deciding rank (the only one that drafts, so the only one the counter sees), against the same
    # call on the unsharded model: the agreement adds none (its tree travels as the host copy the step reads anyway)
    results["round-trips"] = [counted_reads(target, draft, ids), unsharded_reads]
    try:  # a refusal on the deciding rank reaches every rank: none waits for a plan that never comes
        target.generate(ids, assistant_model=draft, speculation="sequoia", max_new_tokens=4, do_sample=True,
                        temperature=0.3, speculation_config={"calibrate_online": False})
        results["refused"] = "no error"
    except ValueError as error:
        results["refused"] = str(error).split(":")[0]
    results["plans"] = sorted(path.name for path in store.user_plan_dir().glob("*.json"))
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or list(METHODS))
