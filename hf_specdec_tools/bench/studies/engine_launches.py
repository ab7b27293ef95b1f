"""Kernel launches per step outside the models' passes, counted on CPU as a GPU would launch them (issue 21/26).

On a GPU a decoding step's host time outside the passes is mostly Python plus one launch per device op (~5-20 µs
of host each). This counts, with a `TorchDispatchMode`, every aten op that would launch a kernel (views,
allocations and metadata queries left out) while `generate` runs and no forward of the target or the draft is on
the stack, and divides by the target's passes after the prompt's (= steps). On a GPU (`--device cuda`, the
default there) only ops touching a GPU tensor count; on a CPU every op does, the engine's host-side tensor work
included, so CPU figures are an upper bound. The pair has the 7B-shaped target's
structure scaled down (28 layers, Qwen's vocabulary, hidden 64; the draft = its first 2 layers, the later layers'
residual writes scaled until the pair agrees on about 80% of greedy tokens, as `gpu.py` builds it on the GPU), so
per-layer work (cache compaction) counts as it would on the real shape. With `--sites`, the ops are also
attributed to the innermost hf_specdec (or transformers) frame that issued them.

    python -m hf_specdec_tools.bench.studies.engine_launches \
        --output benchmarks/results/zen4/engine-launches.json [--sites]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

import hf_specdec  # noqa: E402, F401  (installs `speculation=`)
from hf_specdec.logits import wide_rows  # noqa: E402
from hf_specdec.runtime.devices import cpu_flags, cpu_model  # noqa: E402

from .gpu import early_layer_draft, tune_agreement  # noqa: E402

#: ops that launch nothing on a GPU: allocation, aliasing and shape bookkeeping
FREE = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "sym_size", "sym_stride",
        "sym_numel", "sym_storage_offset", "is_same_size", "set_", "resize_", "_unsafe_view", "scalar_tensor"}
METHODS = {
    "plain": {},
    "assisted (Transformers)": {"assistant": True},
    "chain": {"assistant": True, "speculation": "chain"},
    "sequoia": {"assistant": True, "speculation": "sequoia"},
    "specexec": {"assistant": True, "speculation": "specexec"},
    "staged": {"assistant": True, "speculation": "staged"},
    # the target's tree in the drafted (breadth-first) order, as before `core.pass_shapes.depth_first`
    **{f"{name}, breadth-first": {"assistant": True, "speculation": name, "breadth_first": True}
       for name in ("sequoia", "specexec", "staged")},
}


class LaunchCounter(TorchDispatchMode):
    """Counts launching ops issued while no model forward runs (the models' forward hooks keep `depth`)."""

    def __init__(self, models, sites: bool, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.depth, self.ops, self.sites = 0, 0, collections.Counter() if sites else None
        self.ops_by_name: collections.Counter = collections.Counter()
        for model in models:
            model.register_forward_pre_hook(self._enter)
            model.register_forward_hook(self._leave)

    def _enter(self, *_) -> None:
        self.depth += 1

    def _leave(self, *_) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if self.depth == 0 and not func.is_view and name not in FREE and self._on_device(args, kwargs, out):
            self.ops += 1
            self.ops_by_name[name] += 1
            if self.sites is not None:
                self.sites[site()] += 1
        return out

    def _on_device(self, args, kwargs, out) -> bool:
        """On a GPU: whether the op touches a GPU tensor (host-side tensor work launches nothing). On a CPU every
        op counts, host work included: an upper bound."""
        if self.device.type == "cpu":
            return True
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        return any(t.device.type == self.device.type for t in tensors)


def site() -> str:
    """The innermost frame of hf_specdec (else of transformers) on the stack: `module.function`."""
    frames = traceback.extract_stack()
    for package in ("hf_specdec", "transformers"):
        for frame in reversed(frames):
            if f"/{package}/" in frame.filename:
                module = frame.filename.split(f"/{package}/")[1].removesuffix(".py").replace("/", ".")
                return f"{package}.{module}.{frame.name}"
    return "other"


def pair(device: torch.device, seed: int = 0):
    """A 28-layer scaled-down Qwen2.5-7B-shaped target and its first 2 layers as the draft (~80% agreement)."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=152064, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(device)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    draft = early_layer_draft(target, 2)
    probe = torch.randint(3, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(11)).to(device)
    tuned = tune_agreement(target, draft, 2, 0.8, probe)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # peaked like the GPU runs' `--sharpen 4`
    return target, draft, tuned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--sites", action="store_true", help="Attribute ops to the code that issued them.")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--cpu-paths", action="store_true",
                        help="Keep the CPU-only paths (logits.wide_rows' block argmax/top-k, the drafted tree order); "
                             "by default rows take torch's own ops and the target its tree depth first, as on a GPU.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if not args.cpu_paths:
        wide_rows.WIDE = sys.maxsize  # every row takes torch's argmax/topk: the path a GPU takes
    torch.set_num_threads(1)
    target, draft, tuned = pair(device)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, target.config.vocab_size, (1, 64), generator=generator).to(device)
               for _ in range(args.prompts)]
    counter = LaunchCounter([target, draft], args.sites, device)
    passes = {"target": 0}
    target.register_forward_pre_hook(lambda *_: passes.__setitem__("target", passes["target"] + 1))
    results = []
    for name in args.methods:
        spec = METHODS[name]
        kwargs = {"max_new_tokens": args.new_tokens, "do_sample": False}
        if spec.get("assistant"):
            kwargs["assistant_model"] = draft
        if "speculation" in spec:  # the target's tree depth first, as off the CPU, unless the entry says otherwise
            kwargs["speculation"] = spec["speculation"]
            depth_first = False if spec.get("breadth_first") else None if args.cpu_paths else True
            kwargs["speculation_config"] = {"depth_first": depth_first}
        target.generate(prompts[0], **kwargs)  # warm-up: plans, latency curves, first-call work
        per_step, sites, names = [], collections.Counter(), collections.Counter()
        for ids in prompts:
            counter.ops, passes["target"] = 0, 0
            counter.ops_by_name.clear()
            if counter.sites is not None:
                counter.sites.clear()
            with counter, torch.no_grad():
                target.generate(ids, **kwargs)
            steps = max(passes["target"] - 1, 1)
            per_step.append(counter.ops / steps)
            names.update({op: count / steps for op, count in counter.ops_by_name.items()})
            if counter.sites is not None:
                sites.update({where: count / steps for where, count in counter.sites.items()})
        row = {"method": name, "launches_per_step": statistics.median(per_step),
               "top_ops": {op: round(n / len(prompts), 1) for op, n in names.most_common(12)}}
        if counter.sites is not None:
            row["top_sites"] = {where: round(n / len(prompts), 1) for where, n in sites.most_common(25)}
        results.append(row)
        print(f"{name}: {row['launches_per_step']:.0f} launches per step", flush=True)
        for where, n in row.get("top_sites", {}).items():
            print(f"    {n:7.1f}  {where}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__},
        "pair": {"target": "Qwen2 28 layers, hidden 64, vocab 152,064, float32, sdpa",
                 "draft": "the target's first 2 layers (shared)", "residual_scales": tuned, "output_layer_scale": 4},
        "device": str(device), "cpu_only_paths": args.cpu_paths, "new_tokens": args.new_tokens,
        "prompts": args.prompts, "results": results}, indent=1))


if __name__ == "__main__":
    main()
