"""Engine time per generated token: wall time minus the time spent inside model forward passes, per new token.

Tiny "peaky" random Qwen2-shaped models with Qwen's 151,936-token vocabulary (a scaled output layer makes their
distributions peaked, like a trained model's), the draft a noisy copy of the target, 64 new tokens from 3 prompts,
greedy and sampled (T=0.7, top_k=50, top_p=0.9). Methods: chain, sequoia (a fixed 32-node plan), specexec and
staged (budget 32), next to Transformers' assisted generation (the same draft) and plain decoding. The models'
passes are cheap, so what is left is what the engine costs around them: host round trips and vocabulary-wide work.

    python -m hf_specdec_tools.bench.studies.engine_overhead \
        --output benchmarks/results/zen3/engine-overhead/before.json

`--compare-general` also runs every speculative method on the general processor path (Transformers' processors
on the draft side too, as before `logits/narrowed.py`), interleaved prompt by prompt with the default path, so both
see the same machine load. `--compare-before-21d` does the same with the engine as it was before branch issue21d
(the target's rows on Transformers' path, `torch.multinomial` draws, target sampling walked node by node on the
host with every leaf child's row processed and drawn at its parent). `--compare-before-21e`: the engine before branch
issue21e (every row vocabulary-wide: no top-k columns on the draft or the target side; the stopping criteria handed
Transformers' rows of the accepted path). `--compare-before-21f`: the engine before branch issue21f (with a top-p
after the top-k, the target's rows cut vocabulary-wide, not on their top-k columns). `--compare-before-21g`: torch's
own argmax and top-k over whole rows (before `logits/wide_rows.py`). `--compare-guard-per-call`: the measured guard
judging afresh at each call with the doubling waits only (as before it was remembered across calls). `--top-p 1.0`
samples as the real-pair bench does by default (T=0.7, top-k 50). `--defaults` runs every method as
`speculation="<name>"` gives it (trees sized every step where the method sizes them), `--no-guard` makes every step
speculate (the engine's cost around speculation, never a plain step's).

Prints a table of medians (over prompts) and writes JSON with the machine (CPU model, flags, torch version).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, StagedConfig
from hf_specdec.logits import processing
from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.runtime.devices import cpu_flags, cpu_model

VOCAB = 151_936
NEW_TOKENS = 64
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9}
ACCEPTANCE = [0.6, 0.15, 0.08, 0.05, 0.03, 0.02]  # a plausible sequoia acceptance vector for the 32-node plan


def peaky_model(seed: int, noise: float = 0.0, base: torch.nn.Module | None = None) -> torch.nn.Module:
    """A 2-layer Qwen2 with the full vocabulary; with `base`, a copy of it with Gaussian noise on every weight."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        if base is not None:
            for mine, theirs in zip(model.parameters(), base.parameters()):
                mine.copy_(theirs + noise * theirs.std() * torch.randn_like(theirs))
        else:
            model.lm_head.weight.mul_(12.0)  # peaked next-token distributions
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class ForwardTimer:
    """Seconds spent inside the forward passes of the given models (outermost call only)."""

    def __init__(self, *models: torch.nn.Module) -> None:
        self.seconds, self.passes, self._depth, self._start = 0.0, 0, 0, 0.0
        for model in models:
            model.register_forward_pre_hook(self._enter)
            model.register_forward_hook(self._leave)

    def _enter(self, *_) -> None:
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, *_) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._start
            self.passes += 1


def methods(draft: torch.nn.Module, defaults: bool = False) -> dict[str, dict]:
    """Each method with the fixed trees above, or with `defaults` as `speculation="<name>"` gives them (chain's own
    length and stop, sequoia's plan looked up, specexec's and staged's trees sized every step)."""
    if defaults:
        return {"plain": {}, "assisted (Transformers)": {"assistant_model": draft},
                **{name: {"assistant_model": draft, "speculation": config()} for name, config in
                   (("chain", ChainConfig), ("sequoia", SequoiaConfig), ("specexec", SpecExecConfig),
                    ("staged", StagedConfig))}}
    sequoia = SequoiaConfig(plan=plan_tree(ACCEPTANCE, 32, 8))
    return {
        "plain": {},
        "assisted (Transformers)": {"assistant_model": draft},
        "chain": {"assistant_model": draft, "speculation": ChainConfig(num_draft_tokens=4, confidence_threshold=0)},
        "sequoia": {"assistant_model": draft, "speculation": sequoia},
        "specexec": {"assistant_model": draft, "speculation": SpecExecConfig(budget=32)},
        "staged": {"assistant_model": draft, "speculation": StagedConfig(budget=32)},
    }


def run(target, draft, timer: ForwardTimer, prompt: torch.Tensor, mode: str, kwargs: dict) -> dict:
    sampling = SAMPLING if mode == "sampled" else {"do_sample": False}
    torch.manual_seed(0)
    timer.seconds, timer.passes = 0.0, 0
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(prompt, max_new_tokens=NEW_TOKENS, **sampling, **kwargs)
    wall = time.perf_counter() - start
    tokens = out.shape[1] - prompt.shape[1]
    return {"wall_ms_per_token": 1e3 * wall / tokens, "engine_ms_per_token": 1e3 * (wall - timer.seconds) / tokens,
            "passes": timer.passes, "tokens": tokens}


def general_path() -> contextlib.AbstractContextManager:
    """Every processor list on Transformers' own path (no narrowed top-p, no top-k columns on the draft side)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(processing, "narrowed_plan", lambda processors: None))
    stack.enter_context(mock.patch.object(processing, "topk_split", lambda processors: None))
    return stack


def before_21d() -> contextlib.AbstractContextManager:
    """The engine before branch issue21d, patched in: see the module's docstring."""
    from hf_specdec.verify import random_source, sampling, tree_walk, walk

    def multinomial(self, dist: torch.Tensor) -> torch.Tensor:
        where = self.generator.device if self.generator is not None else dist.device
        return torch.multinomial(dist.to(where), 1, generator=self.generator).to(dist.device)

    def host_walk(self, tree, target_scores, generator=None, *, source=None):
        """Node by node on the host, one read per visited node, every leaf child's row processed and drawn with its
        parent's (a leaf's draw is its bonus)."""
        source = source or random_source.TorchRandom(generator)
        tokens, children_of = tree.host(tokens=True).tokens, tree.host().children()
        dtype = walk.work_dtype(target_scores.device)

        def choose(node: int, children: list[int]):
            leaves = [child for child in children if not children_of[child]]
            drawn = torch.cat([source.draw(target_scores[n].to(dtype).softmax(-1)) for n in (node, *leaves)]).tolist()
            for child in children:
                if tokens[child] == drawn[0]:
                    return child, (drawn[1 + leaves.index(child)] if child in leaves else None)
            return None, drawn[0]

        return tree_walk.walk_down(tree, choose)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(random_source.TorchRandom, "draw", multinomial))
    stack.enter_context(mock.patch.object(sampling.TargetSampleVerifier, "verify", host_walk))
    return stack


def before_21e() -> contextlib.AbstractContextManager:
    """The engine before branch issue21e, patched in: every row vocabulary-wide (no top-k columns on the draft or
    the target side), the stopping criteria handed Transformers' rows of the accepted path."""
    from hf_specdec.decoding import batch_loop, loop

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(processing, "topk_split", lambda processors: None))
    stack.enter_context(mock.patch.object(processing, "exact_top_split", lambda processors: None))
    for module in (loop, batch_loop):
        stack.enter_context(mock.patch.object(module, "block_scores", lambda scores, path, stops: scores[path]))
    return stack


def before_21f() -> contextlib.AbstractContextManager:
    """The engine before branch issue21f, patched in: the target's rows take the top-k columns path only when
    temperature alone follows the top-k; with a top-p they are cut vocabulary-wide (`narrowed.apply_narrowed`)."""
    from transformers import TemperatureLogitsWarper

    def temperature_only(processors):
        split = processing.topk_split(processors)
        return split if split is not None and all(type(p) is TemperatureLogitsWarper for p in split[2]) else None

    return mock.patch.object(processing, "exact_top_split", temperature_only)


def before_21g() -> contextlib.AbstractContextManager:
    """The engine before branch issue21g: torch's own argmax and top-k over every vocabulary-wide row (no block
    maxima, `logits/wide_rows.py`)."""
    from hf_specdec.logits import wide_rows

    return mock.patch.object(wide_rows, "_blocks", lambda rows: None)


def depth_first() -> contextlib.AbstractContextManager:
    """The target's tree handed over depth first, as off the CPU (the `depth_first` setting, for every call)."""
    from hf_specdec.runtime import pass_shapes

    return mock.patch.object(pass_shapes, "orders_depth_first", lambda device, wanted=None: True)


def guard_per_call() -> contextlib.AbstractContextManager:
    """The measured guard as before it was remembered across calls: each call judges afresh, and a lost probe
    waits the doubling backoff only (no wait sized to repay what the probe lost)."""
    from hf_specdec.draft import guarded
    from hf_specdec.integration import batch

    def fresh(target, draft, key, make):
        guard = make()
        guard.probe_share = float("inf")
        return guard

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(guarded, "remembered_guard", fresh))
    stack.enter_context(mock.patch.object(batch, "remembered_guard", fresh))
    return stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/engine-overhead/results.json"))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="Method names to run (default: all).")
    parser.add_argument("--modes", nargs="*", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--compare-general", action="store_true",
                        help="Also run each speculative method on the general processor path, interleaved.")
    parser.add_argument("--compare-before-21d", action="store_true",
                        help="Also run each speculative method on the engine before branch issue21d, interleaved.")
    parser.add_argument("--compare-before-21e", action="store_true",
                        help="Also run each speculative method on the engine before branch issue21e, interleaved.")
    parser.add_argument("--compare-before-21f", action="store_true",
                        help="Also run each speculative method on the engine before branch issue21f, interleaved.")
    parser.add_argument("--compare-before-21g", action="store_true",
                        help="Also run each speculative method with torch's argmax/top-k over whole rows, interleaved.")
    parser.add_argument("--defaults", action="store_true",
                        help="Every method at its defaults (trees sized every step) instead of the fixed trees.")
    parser.add_argument("--no-guard", action="store_true",
                        help="Every method with guard=False: each step speculates (the guard, remembered across "
                        "calls, turns a losing method plain for good here, and plain steps cost no engine).")
    parser.add_argument("--compare-guard-per-call", action="store_true",
                        help="Also run every method with the guard judging afresh at each call, doubling waits only.")
    parser.add_argument("--compare-depth-first", action="store_true",
                        help="Also run each speculative method with the target's tree depth first, interleaved.")
    parser.add_argument("--top-p", type=float, default=SAMPLING["top_p"],
                        help="top_p of the sampled runs (1.0: none, as the real-pair bench samples: T=0.7, top-k 50).")
    args = parser.parse_args()
    SAMPLING["top_p"] = args.top_p
    torch.set_num_threads(args.threads)
    target = peaky_model(0)
    draft = peaky_model(1, noise=0.3, base=target)
    timer = ForwardTimer(target, draft)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 5000, (1, 16 + 8 * i), generator=generator) for i in range(args.prompts)]
    table = methods(draft, args.defaults)
    if args.no_guard:  # every step speculates: the engine's cost around speculation, never a plain step's
        table = {name: {**kwargs, "speculation": dataclasses.replace(kwargs["speculation"], guard=False)}
                 if "speculation" in kwargs else kwargs for name, kwargs in table.items()}
    for name, kwargs in table.items():  # warm-up: first-call costs (plan checks, allocations) out of the medians
        if not args.only or name in args.only:
            run(target, draft, timer, prompts[0][:, :4], "greedy", kwargs)
    results = {}
    for mode in args.modes:
        for name, kwargs in table.items():
            if args.only and name not in args.only:
                continue
            variants = {name: contextlib.nullcontext}
            if args.compare_general and "speculation" in kwargs:
                variants[f"{name} (general path)"] = general_path
            if args.compare_before_21d and "speculation" in kwargs:
                variants[f"{name} (before 21d)"] = before_21d
            if args.compare_before_21e and "speculation" in kwargs:
                variants[f"{name} (before 21e)"] = before_21e
            if args.compare_before_21f and "speculation" in kwargs and mode == "sampled":
                variants[f"{name} (before 21f)"] = before_21f
            if args.compare_before_21g and "speculation" in kwargs:
                variants[f"{name} (before 21g)"] = before_21g
            if args.compare_guard_per_call and "speculation" in kwargs:
                variants[f"{name} (guard per call)"] = guard_per_call
            if args.compare_depth_first and "speculation" in kwargs:
                variants[f"{name} (depth-first)"] = depth_first
            runs: dict[str, list[dict]] = {variant: [] for variant in variants}
            for prompt in prompts:  # interleaved: every variant sees each prompt back to back
                for variant, context in variants.items():
                    with context():
                        runs[variant].append(run(target, draft, timer, prompt, mode, kwargs))
            for variant, variant_runs in runs.items():
                summary = {key: statistics.median(r[key] for r in variant_runs) for key in variant_runs[0]}
                results[f"{mode}/{variant}"] = {**summary, "runs": variant_runs}
                print(f"{mode:8s} {variant:38s} engine {summary['engine_ms_per_token']:7.2f} ms/token   "
                      f"wall {summary['wall_ms_per_token']:7.2f} ms/token   passes {summary['passes']:5.0f}",
                      flush=True)
    machine = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": args.threads,
               "transformers": __import__("transformers").__version__}
    print(f"machine: {machine}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": machine, "new_tokens": NEW_TOKENS, "vocab": VOCAB,
                                       "results": results}, indent=1))


if __name__ == "__main__":
    main()
