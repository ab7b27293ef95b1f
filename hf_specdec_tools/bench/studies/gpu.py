"""On a CUDA GPU, in one run: correctness in three dtypes, syncs per step, latency profiles of a 7B-shaped target,
end-to-end speed in memory and with the target offloaded to CPU RAM.

Real weights cannot reach the GPU machine, so the models are random, of real shapes, built on the device:
- correctness: the 2-layer Qwen2 with Qwen's 151,936-token vocabulary of `engine_overhead.py` (peaked output
  layer) and a noisy copy as draft; every method, float32/float16/bfloat16, sdpa/eager: greedy against plain
  (float32 must be identical; half precision reports the share of tokens agreeing), and flash-attention refused;
- syncs: `torch.cuda.set_sync_debug_mode("warn")` warnings per target pass, inside the models' forwards and outside
  them (the engine), greedy and sampled, next to plain and Transformers' assisted generation;
- latency: a Qwen2.5-7B-shaped target and a Qwen2.5-0.5B-shaped draft in bfloat16, one pass over n = 1...2048 tree
  tokens after 256 cached ones (`plan.latency.measure_latency`), sdpa and eager, stored as the plugin's profile JSON;
- speed in memory: the draft is the target's own first `--draft-layers` layers (shared weights), the target's
  later layers' residual writes scaled down until the draft agrees with it on about `--agreement` of the tokens
  of a random prompt (a known acceptance: the pair is synthetic), greedy, methods at their defaults next to plain
  and Transformers' assisted generation with the same draft;
- offloaded: the same target with its layers in CPU RAM (accelerate `dispatch_model`, the draft a copy on the GPU):
  SpecExec at several budgets against plain and Transformers' assisted, both offloaded.
- static: the same pair on a static cache, where Transformers compiles the target's forward (CUDA graphs) and the
  tree passes share that compiled call (the draft on a static cache of its own, compiled alike; each pass size
  runs compiled only where its first pass measured the compiled call faster), against plain static-cache generate
  compiled the same way;
- steps: where a step's time goes, per method: target and draft passes timed by forward hooks (host clock and CUDA
  events), the rest outside them;
- batches: B = 1...16 random prompts in one batch, greedy, speculative methods against plain batched `generate`
  (Transformers' assisted generation takes one sequence, so it has no row here), tokens per target step per row.
Speed phases interleave the methods within each round (`interleaved`): a GPU machine's host changes speed during a
run, so rows timed one after another compare moments, not methods.

Each phase writes its JSON as soon as it ends, so a run cut short keeps what it finished; `--deadline` seconds
bounds the whole run (a phase that would not fit is skipped and says so). `--smoke` runs every phase with small
shapes on any device (a check of this script on a CPU before a GPU run).

    python -m hf_specdec_tools.bench.studies.gpu --output results/            # on the GPU machine
    .venv/bin/python -m hf_specdec_tools.bench.studies.gpu --smoke --output /tmp/gpu-smoke
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import dataclasses
import io
import json
import os
import platform
import pstats
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import transformers
from torch.nn.attention import SDPBackend
from transformers import AutoModelForCausalLM, Qwen2Config

os.environ.setdefault("HF_SPECDEC_CACHE", tempfile.mkdtemp(prefix="hf-specdec-gpu-"))

import hf_specdec  # noqa: E402, F401  (installs `speculation=`)
from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, StagedConfig, TreeConfig  # noqa: E402
from hf_specdec.core.releases import ASSISTED_ON_STATIC_CACHE, cache_arg, given_cache  # noqa: E402
from hf_specdec.kernels import lean_pass  # noqa: E402
from hf_specdec.methods.sequoia.dp import plan_tree  # noqa: E402
from hf_specdec.methods.sequoia.plan_file import pair_placement  # noqa: E402
from hf_specdec.plan.latency import measure_latency  # noqa: E402
from hf_specdec.plan.sizing import HardwareProfile  # noqa: E402
from hf_specdec.runtime import attention  # noqa: E402
from hf_specdec.runtime.attention import tree_attention_kernels  # noqa: E402

from .engine_overhead import ACCEPTANCE, SAMPLING, peaky_model  # noqa: E402

#: the fixed shapes the static phase runs through the loop and captured whole (decoding/captured.py)
CAPTURED = {"chain 4": ChainConfig(num_draft_tokens=4, confidence_threshold=0, per_step=False),
            "chain 8": ChainConfig(num_draft_tokens=8, confidence_threshold=0, per_step=False),
            "sequoia plan 32": SequoiaConfig(plan=plan_tree(ACCEPTANCE, 32, 8)),
            # a best-first tree of one budget, grown on the device when captured (greedy only)
            "specexec 32": SpecExecConfig(budget=32)}


def fixed_chain(length: int, **settings) -> ChainConfig:
    """A chain of `length` tokens every step (no confidence stop): the same passes whatever the draft proposes."""
    return ChainConfig(num_draft_tokens=length, confidence_threshold=0, **settings)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FIXED = {  # correctness and syncs: fixed shapes, so every dtype and kernel runs the same trees
    "chain": fixed_chain(4),
    "tree": TreeConfig(widths=[3, 2]),
    "sequoia": SequoiaConfig(plan=plan_tree(ACCEPTANCE, 32, 8)),
    "specexec": SpecExecConfig(budget=32),
    "staged": StagedConfig(budget=32),
}
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=True)
SMOKE_TARGET = dict(QWEN_7B, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)
SMOKE_DRAFT = dict(SMOKE_TARGET, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
NO_CUDNN = "no_cudnn_sdpa"  # a table entry's switch: the whole call runs with the kernels our tree passes use
CUDNN_KEPT = "cudnn_sdpa_kept"  # a table entry's switch: our tree passes keep cuDNN's SDPA (as before they left it)
MODEL_FORWARD = "draft_model_forward"  # a table entry's switch: the draft runs its model's forward (no lean pass)
EVERY_KERNEL = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class Run:
    """The run's clock, device and output folder: every phase checks the deadline and writes its own file."""

    def __init__(self, args) -> None:
        self.args, self.start = args, time.perf_counter()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.output.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.args.deadline - (time.perf_counter() - self.start)

    def write(self, name: str, data: dict) -> None:
        data = {"environment": environment(self.device), "seconds_into_run": round(time.perf_counter() - self.start, 1),
                **data}
        (self.args.output / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"[{time.perf_counter() - self.start:6.1f} s] wrote {name}.json", flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, target, ids, new_tokens: int, kwargs: dict):
        """(output, seconds) of one `generate` call, the device synchronised on both sides. A table entry with
        `NO_CUDNN` set runs the whole call with cuDNN's SDPA kernel off (our eager tree passes do so by themselves);
        one with `CUDNN_KEPT` lets our tree passes use it; one with `MODEL_FORWARD` runs the draft through its
        model's forward (before `kernels/lean_pass.py`)."""
        self.sync()
        start = time.perf_counter()
        with contextlib.ExitStack() as kernels:
            if kwargs.get(NO_CUDNN):
                kernels.enter_context(tree_attention_kernels(self.device))
            if kwargs.get(CUDNN_KEPT):
                kernels.enter_context(mock.patch.object(attention, "TREE_KERNELS", EVERY_KERNEL))
            if kwargs.get(MODEL_FORWARD):
                kernels.enter_context(mock.patch.object(lean_pass, "SUPPORTED", ()))
            out = generate(target, ids, new_tokens, **call_kwargs(kwargs))
        self.sync()
        return out, time.perf_counter() - start


def environment(device: torch.device) -> dict:
    found = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
             "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return found


def generate(target, ids, new_tokens: int, sampled: bool = False, **kwargs):
    sampling = SAMPLING if sampled else {"do_sample": False}
    torch.manual_seed(0)
    with torch.no_grad():
        return target.generate(ids, max_new_tokens=new_tokens, return_dict_in_generate=True, **sampling, **kwargs)


# ----------------------------------------------------------------------------------------------- correctness


def correctness(run: Run) -> None:
    smoke, results = run.args.smoke, []
    prompts = [torch.randint(3, 5000, (1, 16 + 24 * i), generator=torch.Generator().manual_seed(i)).to(run.device)
               for i in range(2)]
    base_target = peaky_model(0)
    base_draft = peaky_model(1, noise=0.3, base=base_target)
    for dtype_name, dtype in DTYPES.items():
        for attn in ("sdpa", "eager"):
            target = copy.deepcopy(base_target).to(run.device, dtype)
            draft = copy.deepcopy(base_draft).to(run.device, dtype)
            target.set_attn_implementation(attn)
            draft.set_attn_implementation(attn)
            plain = [generate(target, ids, 16 if smoke else 32).sequences for ids in prompts]
            for name, config in FIXED.items():
                row = {"dtype": dtype_name, "attn": attn, "method": name, "identical": True, "agreeing": 0,
                       "tokens": 0, "first_difference": []}
                try:
                    for ids, want in zip(prompts, plain):
                        out = generate(target, ids, want.shape[1] - ids.shape[1], assistant_model=draft,
                                       speculation=config)
                        got, new = out.sequences[0, ids.shape[1]:], want[0, ids.shape[1]:]
                        same = (got == new).cpu()
                        row["identical"] &= bool(same.all())
                        row["agreeing"] += int(same.sum())
                        row["tokens"] += len(new)
                        row["first_difference"].append(int((~same).nonzero()[0]) if not same.all() else None)
                        row["tokens_per_step"] = round(out.speculation_stats.mean_tokens_per_step, 2)
                except Exception as exc:  # reported, not raised: the other cells still run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                row["agreement"] = row["agreeing"] / max(row["tokens"], 1)
                results.append(row)
                print(f"  {dtype_name:8} {attn:5} {name:8} identical={row['identical']} "
                      f"agreement={row['agreement']:.3f} {row.get('error', '')}", flush=True)
    flash = copy.deepcopy(base_target).to(run.device)
    flash.config._attn_implementation = "flash_attention_2"
    try:
        generate(flash, prompts[0], 4, assistant_model=copy.deepcopy(base_draft).to(run.device), speculation="chain")
        refused = "not refused"
    except ValueError as exc:
        refused = str(exc)
    run.write("correctness", {"results": results, "flash_attention": refused})


# ----------------------------------------------------------------------------------------------------- syncs


class SyncCounter:
    """Counts CUDA synchronising operations (their sync-debug warnings), inside model forwards and outside."""

    def __init__(self, *models) -> None:
        self.inside = self.outside = 0
        self.depth, self.passes = 0, 0
        self.target = models[0]
        for model in models:
            model.register_forward_pre_hook(self._enter)
            model.register_forward_hook(self._leave)
        self.target.register_forward_pre_hook(self._count_pass)

    def _enter(self, *_) -> None:
        self.depth += 1

    def _leave(self, *_) -> None:
        self.depth -= 1

    def _count_pass(self, *_) -> None:
        if self.depth == 1:
            self.passes += 1

    def show(self, message, category, *rest) -> None:
        if "synchronizing" in str(message):
            if self.depth:
                self.inside += 1
            else:
                self.outside += 1

    def measure(self, call) -> dict:
        self.inside = self.outside = self.passes = 0
        shown = warnings.showwarning
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self.show
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = call()
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = shown
        passes = max(self.passes - 1, 1)  # the prompt's pass is not a step
        return {"target_passes": self.passes, "engine_syncs": self.outside, "model_syncs": self.inside,
                "engine_syncs_per_step": round(self.outside / passes, 2),
                "all_syncs_per_step": round((self.outside + self.inside) / passes, 2),
                "new_tokens": int(out.sequences.shape[1])}


def syncs(run: Run) -> None:
    target = peaky_model(0).to(run.device)
    draft = peaky_model(1, noise=0.3, base=target).to(run.device)
    counter = SyncCounter(target, draft)
    ids = torch.randint(3, 5000, (1, 24), generator=torch.Generator().manual_seed(5)).to(run.device)
    table = {"plain": {}, "assisted (Transformers)": {"assistant_model": draft},
             **{name: {"assistant_model": draft, "speculation": config} for name, config in FIXED.items()}}
    results = []
    for mode in ("greedy", "sampled"):
        for name, kwargs in table.items():
            generate(target, ids, 8, mode == "sampled", **kwargs)  # warm-up
            row = {"mode": mode, "method": name,
                   **counter.measure(lambda kw=kwargs, m=mode: generate(target, ids, 48, m == "sampled", **kw))}
            results.append(row)
            print(f"  {mode:7} {name:24} engine syncs/step {row['engine_syncs_per_step']:6.2f}, "
                  f"in models {row['model_syncs']}, passes {row['target_passes']}", flush=True)
    run.write("syncs", {"results": results, "new_tokens": 48,
                        "note": "per step = per target pass after the prompt's; plain: per token"})


# --------------------------------------------------------------------------------------------------- latency


def random_model(shape: dict, run: Run, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(**shape, **IDS)
    with torch.device(run.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sizes(run: Run) -> list[int]:
    return [1, 2, 4, 8, 16, 64] if run.args.smoke else [2**i for i in range(12)]


def latency(run: Run, target, draft) -> dict:
    curves, profiles = {}, {}
    for attn in ("sdpa", "eager"):
        for model in (target, draft):
            model.set_attn_implementation(attn)
        pair = {}
        for role, model in (("target", target), ("draft", draft)):
            run.sync()
            pair[role] = measure_latency(model, sizes(run), repeats=3, progress=False, stop_ratio=None)
            curves[f"{role} {attn}"] = dict(zip(pair[role].sizes, pair[role].seconds))
            print(f"  {role} {attn}: " + ", ".join(f"{n}:{1e3 * t:.1f}ms" for n, t in curves[f'{role} {attn}'].items()),
                  flush=True)
        profiles[attn] = HardwareProfile(pair["target"], pair["draft"], pair_placement(target, draft)).to_dict()
    for model in (target, draft):
        model.set_attn_implementation("sdpa")
    return {"curves_seconds": curves, "profiles": profiles}


def pass_costs(run: Run, model, label: str, repeats: int = 10) -> dict:
    """Milliseconds of one one-token pass after 256 cached tokens, called as plain decoding calls it (a 2-D mask)
    and as a tree pass (the 4-D tree mask and position ids), and where the host spends a tree pass (profiler)."""
    from transformers import DynamicCache

    from hf_specdec.accept.kv_cache import crop
    from hf_specdec.core.tree import TokenTree
    from hf_specdec.runtime.attention import AttentionLayout

    past, device = 256, run.device
    ids = torch.randint(3, 1000, (1, past), generator=torch.Generator().manual_seed(3)).to(device)
    cache = DynamicCache()
    star = TokenTree.from_parents([7], [-1])
    calls = {
        "plain (2-D mask)": dict(input_ids=star.tokens[None].to(device),
                                 attention_mask=torch.ones(1, past + 1, dtype=torch.long, device=device)),
        "tree (4-D mask)": dict(input_ids=star.tokens[None].to(device),
                                attention_mask=AttentionLayout.of(model).tree_masks(star, past, model.dtype, device),
                                position_ids=star.position_ids(past).to(device)),
    }
    found = {}
    with torch.no_grad():
        model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        for name, kwargs in calls.items():
            times = []
            for _ in range(repeats + 1):
                run.sync()
                start = time.perf_counter()
                model(**kwargs, **cache_arg(cache), use_cache=True)
                run.sync()
                times.append(1e3 * (time.perf_counter() - start))
                crop(cache, past)
            found[name] = round(statistics.median(times[1:]), 2)
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(3):
                model(**calls["tree (4-D mask)"], **cache_arg(cache), use_cache=True)
                crop(cache, past)
    found["host_profile"] = profile.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    print(f"  {label}: " + ", ".join(f"{k} {v} ms" for k, v in found.items() if k != "host_profile"), flush=True)
    return found


# ------------------------------------------------------------------------------------------ synthetic pair


def early_layer_draft(target, layers: int) -> torch.nn.Module:
    """A draft made of the target's embedding, first `layers` layers, final norm and output layer (shared)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype, attn_implementation="sdpa").eval()
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(list(target.model.layers[:layers]))
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft.model.rotary_emb = target.model.rotary_emb
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft


def agreement(target, draft, ids) -> float:
    with torch.no_grad():
        return float((target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).float().mean())


def tune_agreement(target, draft, layers: int, wanted: float, ids) -> list[tuple[float, float]]:
    """Scale the residual writes of the layers the draft lacks until the pair agrees on `wanted` of the tokens."""
    tried, scale = [], 1.0
    for next_scale in (1.0, 0.5, 0.3, 0.2, 0.12, 0.08, 0.05, 0.03, 0.02, 0.01):
        with torch.no_grad():
            for layer in target.model.layers[layers:]:
                layer.self_attn.o_proj.weight.mul_(next_scale / scale)
                layer.mlp.down_proj.weight.mul_(next_scale / scale)
        scale = next_scale
        tried.append((scale, agreement(target, draft, ids)))
        print(f"  residual scale {scale}: agreement {tried[-1][1]:.3f}", flush=True)
        if tried[-1][1] >= wanted:
            break
    return tried


def speed(run: Run, target, draft, methods: dict, prompts, new_tokens: int, rounds: int, warm_up: bool = True
          ) -> list[dict]:
    """Tokens per second of each method (median over prompts and rounds, methods interleaved), tokens per target
    pass, draft passes per target pass, the engine's share of the wall time (outside the models' passes), identity
    with plain. A method's `new_tokens` entry overrides the phase's (a slow plain row decodes fewer)."""
    passes = {"target": 0, "draft": 0}
    hooks = [model.register_forward_pre_hook(lambda *_, role=role: passes.__setitem__(role, passes[role] + 1))
             for role, model in (("target", target), ("draft", draft))]
    outputs: dict[str, list] = {}

    def measure(name: str, kwargs: dict, ids) -> dict:
        tokens = kwargs.get("new_tokens", new_tokens)
        passes.update(target=0, draft=0)
        out, seconds = run.timed(target, ids, tokens, kwargs)
        steps = max(passes["target"] - 1, 1)  # the prompt's pass is not a step
        outputs.setdefault(name, []).append(out.sequences[0, ids.shape[1]:].cpu())
        row = {"tokens_per_second": tokens / seconds, "tokens_per_target_pass": (tokens - 1) / steps,
               "draft_passes_per_target_pass": passes["draft"] / steps}
        stats = getattr(out, "speculation_stats", None)
        if stats is not None:
            inside = stats.time_target_forward + stats.time_draft_forward
            row.update(tokens_per_step=stats.mean_tokens_per_step, plan_source=stats.plan_source,
                       engine_share=1 - inside / max(stats.time_total, 1e-9))
        return row

    rows = interleaved(run, target, methods, prompts, new_tokens, rounds, measure, warm_up)
    for hook in hooks:
        hook.remove()
    results = [{"method": name, "new_tokens": methods[name].get("new_tokens", new_tokens), **medians(found)}
               for name, found in rows.items()]
    reference = next((r for r in results if r["method"].startswith("plain") and r["method"] in outputs), None)
    for row in results:
        if reference is not None and row["method"] in outputs:
            row["identical_to_plain"] = all(torch.equal(a[: len(b)], b[: len(a)])
                                            for a, b in zip(outputs[row["method"]], outputs[reference["method"]]))
            row["speedup_vs_plain"] = round(row["tokens_per_second"] / reference["tokens_per_second"], 2)
        print(f"  {row}", flush=True)
    return results


class PassClock:
    """Host and device milliseconds inside each model's passes during a call (forward hooks: `perf_counter` and CUDA
    events, read once after the call), so a step's time splits into target, draft and everything else."""

    def __init__(self, **models) -> None:
        self.cuda = torch.cuda.is_available()
        self.marks: dict[str, list] = {role: [] for role in models}
        self.hooks = []
        for role, model in models.items():
            self.hooks.append(model.register_forward_pre_hook(
                lambda _, args, kwargs, r=role: self._mark(r, "start", args, kwargs), with_kwargs=True))
            self.hooks.append(model.register_forward_hook(lambda *_, r=role: self._mark(r, "end")))
        self.open: dict[str, tuple] = {}
        self.shapes: dict[str, list[tuple[int, int]]] = {role: [] for role in models}  # (tokens, cached rows)

    def _mark(self, role: str, edge: str, args=(), kwargs=None) -> None:
        event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        if event is not None:
            event.record()
        if edge == "start":
            self.open[role] = (time.perf_counter(), event)
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = given_cache(kwargs)
            cached = cache.get_seq_length() if cache is not None else 0
            if ids is not None and not isinstance(cached, torch.Tensor):  # a static cache's is on the device: no read
                self.shapes[role].append((int(ids.shape[-1]), int(cached)))
        else:
            started, first = self.open.pop(role)
            self.marks[role].append((time.perf_counter() - started, first, event))

    def reset(self) -> None:
        for marks in (*self.marks.values(), *self.shapes.values()):
            marks.clear()

    def summary(self) -> dict:
        """Per role: passes, host ms summed over passes, device ms summed (None on a CPU)."""
        if self.cuda:
            torch.cuda.synchronize()
        found = {}
        for role, marks in self.marks.items():
            device = sum(a.elapsed_time(b) for _, a, b in marks) if self.cuda else None
            found[role] = {"passes": len(marks), "host_ms": 1e3 * sum(h for h, _, _ in marks), "device_ms": device}
            decoding = [(t, c) for t, c in self.shapes[role] if c > 0]  # the prompt's pass left out
            tokens = [t for t, _ in decoding] or [0]
            found[role].update(mean_tokens=statistics.mean(tokens), max_tokens=max(tokens),
                               distinct_token_counts=len(set(tokens)),
                               max_cached_rows=max((c for _, c in decoding), default=0))
        return found

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def interleaved(run: Run, target, table: dict, prompts, new_tokens: int, rounds: int, measure,
                warm_up: bool = True) -> dict[str, list[dict]]:
    """`measure(name, kwargs, ids)` for every method, prompt and round, the methods taking turns within a round: the
    host of a GPU machine changes speed during a run (a one-token 7B-shaped pass took 41 ms at one minute and 20 ms
    at the next), so methods timed one after another would compare moments, not methods. Each method's first call,
    on the first prompt with as many new tokens as the timed ones (the same cache shapes, so the same graphs), is a
    warm-up: plan lookup, curves, allocations, compilation; its seconds are kept (`warm_up=False`: none, where a
    pass costs seconds)."""
    rows: dict[str, list[dict]] = {}
    for name, kwargs in table.items():
        if not warm_up:
            rows[name] = []
            continue
        if run.left() < 60:
            rows[name] = [{"skipped": "deadline"}]
            continue
        try:
            seconds = run.timed(target, prompts[0], kwargs.get("new_tokens", new_tokens), kwargs)[1]
        except Exception as exc:
            rows[name] = [{"error": f"{type(exc).__name__}: {exc}"[:600]}]
            continue
        rows[name] = [{"first_call_seconds": round(seconds, 1)}]
        print(f"  [{time.perf_counter() - run.start:6.1f} s] warm-up {name}: {rows[name][0]}", flush=True)
    for round_ in range(rounds):
        if run.left() < 30 + 10 * len(rows):
            break
        for name, kwargs in table.items():
            if name in rows and not (rows[name] and ({"error", "skipped"} & rows[name][0].keys())):
                for ids in prompts:
                    if run.left() < 30:  # a call may take seconds (offloaded): stop short of the deadline
                        break
                    try:
                        rows[name].append({"round": round_, **measure(name, kwargs, ids)})
                    except Exception as exc:  # one method failing does not cost the others their rows
                        rows[name].insert(0, {"error": f"{type(exc).__name__}: {exc}"[:600]})
                        break
    return rows


def call_kwargs(kwargs: dict) -> dict:
    """A table entry's `generate` arguments (its `new_tokens` overrides the phase's count, `NO_CUDNN` and
    `CUDNN_KEPT` pick the kernels: none is one)."""
    return {k: v for k, v in kwargs.items() if k not in ("new_tokens", NO_CUDNN, CUDNN_KEPT, MODEL_FORWARD)}


def medians(rows: list[dict], skip=("round",)) -> dict:
    timed = [r for r in rows if "round" in r]
    found = {k: v for r in rows if "round" not in r for k, v in r.items()}
    if timed:
        for key in timed[0]:
            if key not in skip and isinstance(timed[0][key], (int, float)) and not isinstance(timed[0][key], bool):
                found[key] = round(statistics.median(r[key] for r in timed), 2)
            elif key not in skip:
                found[key] = timed[-1][key]
        found["timed_calls"] = len(timed)
    return found


def step_parts(run: Run, target, draft, prompts, new_tokens: int, rounds: int = 3) -> dict:
    """Where a step's time goes, per method at the defaults and at fixed sizes: wall ms per step, and inside it the
    target's and the draft's passes (host ms: Python and kernel launches inside the forward; device ms: the GPU's
    time between the forward's first and last event), the rest being the engine and the host-device waits."""
    table = {"plain": {}, "assisted (Transformers)": {"assistant_model": draft},
             "chain": {"assistant_model": draft, "speculation": "chain"},
             "chain 4, guard off": {"assistant_model": draft,
                                    "speculation": fixed_chain(4, guard=False)},
             "chain 8": {"assistant_model": draft, "speculation": fixed_chain(8)},
             "sequoia": {"assistant_model": draft, "speculation": "sequoia"},
             "specexec": {"assistant_model": draft, "speculation": "specexec"},
             # our eager tree passes leave cuDNN's SDPA out (core.attention): the same calls with it kept
             **{f"{name}, cuDNN kept": {"assistant_model": draft, "speculation": name, CUDNN_KEPT: True}
                for name in ("chain", "sequoia", "specexec")},
             # the target's tree in the drafted (breadth-first) order: the cache compaction moves rows more often
             **{f"{name}, breadth-first": {"assistant_model": draft, "speculation": name,
                                                 "speculation_config": {"depth_first": False}}
                for name in ("sequoia", "specexec", "staged")},
             # the draft through its model's own forward, not the lean pass (`kernels/lean_pass.py`)
             **{f"{name}, model forward": {"assistant_model": draft, "speculation": name, MODEL_FORWARD: True}
                for name in ("chain", "sequoia", "specexec")},
             # the target's tree passes through its model's own forward, not the lean pass (`decoding.step.lean_target`)
             **{f"{name}, target forward": {"assistant_model": draft, "speculation": name,
                                                  "speculation_config": {"lean_target": False}}
                for name in ("chain", "sequoia", "specexec", "staged")},
             "staged": {"assistant_model": draft, "speculation": "staged"}}
    if run.args.only:
        table = {name: kwargs for name, kwargs in table.items() if name in run.args.only}
    clock = PassClock(target=target, draft=draft)

    def measure(name: str, kwargs: dict, ids) -> dict:
        run.sync()
        clock.reset()
        allocations = torch.cuda.memory_stats().get("num_device_alloc", 0) if run.device.type == "cuda" else 0
        out, seconds = run.timed(target, ids, new_tokens, kwargs)
        wall = 1e3 * seconds
        parts = clock.summary()
        steps = max(parts["target"]["passes"] - 1, 1)  # the prompt's pass is not a step
        row = {"tokens_per_second": new_tokens / wall * 1e3, "wall_ms_per_step": wall / steps,
               "tokens_per_step": (new_tokens - 1) / steps, "draft_passes_per_step": parts["draft"]["passes"] / steps}
        for role in ("target", "draft"):
            passes = max(parts[role]["passes"], 1)
            row[f"{role}_host_ms_per_pass"] = parts[role]["host_ms"] / passes
            if parts[role]["device_ms"] is not None:
                row[f"{role}_device_ms_per_pass"] = parts[role]["device_ms"] / passes
        row["outside_passes_ms_per_step"] = (wall - parts["target"]["host_ms"] - parts["draft"]["host_ms"]) / steps
        for role in ("target", "draft"):  # pass shapes: a GPU pays for every new one (kernel choice, allocations)
            for key in ("mean_tokens", "max_tokens", "distinct_token_counts", "max_cached_rows"):
                row[f"{role}_{key}"] = parts[role][key]
        if run.device.type == "cuda":
            row["device_allocations"] = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocations
        stats = getattr(out, "speculation_stats", None)
        if stats is not None:
            row.update(plain_steps=stats.plain_steps, shrunk_steps=stats.shrunk_steps)
        return row

    rows = interleaved(run, target, table, prompts, new_tokens, rounds, measure)
    clock.remove()
    results = [{"method": name, **medians(found)} for name, found in rows.items()]
    for row in results:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    profiles = {}  # one call each of a fixed-shape and a sized method, host and device: where the host time goes
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    for name in ("chain", "sequoia"):
        if any("round" in row for row in rows.get(name, [])) and run.left() > 30:  # it ran: profile one call
            with torch.profiler.profile(activities=activities) as profile:
                generate(target, prompts[0], new_tokens, **call_kwargs(table[name]))
            profiles[name] = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    for name in ("sequoia", "specexec"):  # the Python around the ops: where the engine's host time goes
        if any("round" in row for row in rows.get(name, [])) and run.left() > 30:
            profiler = cProfile.Profile()
            with profiler:
                generate(target, prompts[0], new_tokens, **call_kwargs(table[name]))
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(
                    *(("hf_specdec", 70) if order == "cumulative" else (50,)))
                profiles[f"{name}, cProfile by {order}"] = text.getvalue()
    return {"new_tokens": new_tokens, "prompts": len(prompts), "rounds": rounds, "results": results,
            "per_call": rows, "profiles": profiles}


def static_speed(run: Run, target, draft, prompts, new_tokens: int, rounds: int = 3) -> dict:
    """Whole calls on a static cache, where Transformers compiles the target's forward (CUDA graphs on a GPU) and
    hf_specdec's tree passes use the same compiled call, next to the eager dynamic-cache calls a user has today:
    the first call's seconds (compilation), graphs compiled, tree sizes, tokens/s (median, methods interleaved)."""
    static = {"cache_implementation": "static"}
    table = {"plain (dynamic, eager)": {}, "assisted (Transformers, dynamic, eager)": {"assistant_model": draft},
             "plain (static, compiled)": static,
             **({"assisted (Transformers, static, compiled)": {"assistant_model": draft, **static}}
                if ASSISTED_ON_STATIC_CACHE else {}),
             "chain (static)": {"assistant_model": draft, "speculation": "chain", **static},
             "chain 8 (static)": {"assistant_model": draft, "speculation": fixed_chain(8), **static},
             "sequoia (static)": {"assistant_model": draft, "speculation": "sequoia", **static},
             # at the defaults (sized every step, from a few bucketed shapes; the guard on), each step captured whole
             "sequoia (static, captured)": {"assistant_model": draft, **static,
                                            "speculation": SequoiaConfig(captured=True)},
             "chain (static, captured)": {"assistant_model": draft, **static,
                                          "speculation": ChainConfig(captured=True)},
             "specexec (static)": {"assistant_model": draft, "speculation": "specexec", **static},
             "specexec (static, captured)": {"assistant_model": draft, **static,
                                             "speculation": SpecExecConfig(captured=True)},
             # fixed shapes every step (no guard), through the loop and as one captured step (compiled whole)
             **{f"{name} (static{how})": {"assistant_model": draft, **static,
                                          "speculation": dataclasses.replace(config, guard=False, captured=captured)}
                for name, config in CAPTURED.items() for how, captured in ((", fixed", False), (", captured", True))},
             # sampled (engine_overhead's SAMPLING: temperature, top-k, top-p, all row-wise): plain, Transformers', the
             # captured sequoia plan and specexec budget, whose draws and walk run inside their graphs
             "plain (static, compiled, sampled)": {**static, "sampled": True},
             **({"assisted (Transformers, static, compiled, sampled)": {"assistant_model": draft, **static,
                                                                        "sampled": True}}
                if ASSISTED_ON_STATIC_CACHE else {}),
             "sequoia plan 32 (static, captured, sampled)": {
                 "assistant_model": draft, **static, "sampled": True,
                 "speculation": dataclasses.replace(CAPTURED["sequoia plan 32"], guard=False, captured=True)},
             "specexec 32 (static, captured, sampled)": {
                 "assistant_model": draft, **static, "sampled": True,
                 "speculation": dataclasses.replace(CAPTURED["specexec 32"], guard=False, captured=True)}}

    def measure(name: str, kwargs: dict, ids) -> dict:
        out, seconds = run.timed(target, ids, new_tokens, kwargs)
        row = {"tokens_per_second": new_tokens / seconds}
        stats = getattr(out, "speculation_stats", None)
        if stats is not None:
            row.update(tokens_per_step=stats.mean_tokens_per_step, compiled=stats.compiled,
                       tree_pass_sizes=sorted(stats.tree_pass_sizes), graphs_compiled=stats.graphs_compiled,
                       draft_pass_sizes=sorted(stats.draft_pass_sizes), sizes_kept_eager=sorted(stats.sizes_kept_eager),
                       draft_sizes_kept_eager=sorted(stats.draft_sizes_kept_eager),
                       draft_ms_per_pass=1e3 * stats.time_draft_forward / max(stats.draft_forwards, 1),
                       target_ms_per_pass=1e3 * stats.time_target_forward / max(stats.target_forwards, 1))
        return row

    rows = interleaved(run, target, table, prompts, new_tokens, rounds, measure)
    results = [{"method": name, **medians(found)} for name, found in rows.items()]
    by_name = {r["method"]: r.get("tokens_per_second") for r in results}
    for row in results:
        for ref in ("plain (static, compiled)", "plain (dynamic, eager)", "assisted (Transformers, dynamic, eager)",
                    "assisted (Transformers, static, compiled)", "plain (static, compiled, sampled)",
                    "assisted (Transformers, static, compiled, sampled)"):
            if row.get("tokens_per_second") and by_name.get(ref):
                row[f"vs {ref}"] = round(row["tokens_per_second"] / by_name[ref], 2)
        print(f"  {row}", flush=True)
    return {"new_tokens": new_tokens, "prompts": len(prompts), "rounds": rounds, "results": results,
            "per_call": rows}


def batch_speed(run: Run, target, draft, new_tokens: int, sizes=(1, 2, 4, 8, 16), rounds: int = 2) -> dict:
    """A batch of B different random prompts (equal length, so no padding) per B: plain batched `generate` and the
    speculative methods at their defaults, interleaved per B, medians; tokens/s counts every row's new tokens."""
    generator = torch.Generator().manual_seed(23)
    vocab = target.config.vocab_size

    def measure(name: str, kwargs: dict, ids) -> dict:
        out, seconds = run.timed(target, ids, new_tokens, kwargs)
        rows = ids.shape[0]
        row = {"tokens_per_second": rows * new_tokens / seconds}
        stats = getattr(out, "speculation_stats", None)
        if stats is not None:
            stats = stats if isinstance(stats, list) else [stats]
            row["tokens_per_target_step_per_row"] = statistics.mean(
                s.new_tokens / max(s.target_forwards, 1) for s in stats)
        return row

    found = {}
    for size in sizes:
        if run.left() < 60:
            found[size] = {"skipped": "deadline"}
            continue
        batch = torch.randint(3, vocab, (size, 64), generator=generator).to(run.device)
        mask = {"attention_mask": torch.ones_like(batch)}  # as a tokenizer returns it
        table = {"plain (batched)": mask, "plain (batched), no cuDNN SDPA": {**mask, NO_CUDNN: True},
                 **{name: {"assistant_model": draft, "speculation": name, **mask}
                    for name in ("chain", "sequoia", "specexec")},
                 # the target's tree passes through its forward, not the lean pass (`decoding.step.lean_target`)
                 **{f"{name}, target forward": {"assistant_model": draft, "speculation": name,
                                                "speculation_config": {"lean_target": False}, **mask}
                    for name in ("chain", "sequoia")}}
        if run.args.only:
            table = {name: kwargs for name, kwargs in table.items() if name in run.args.only}
        rows = interleaved(run, target, table, [batch], new_tokens, rounds, measure)
        results = [{"method": name, **medians(r)} for name, r in rows.items()]
        by_name = {r["method"]: r.get("tokens_per_second") for r in results}
        for row in results:
            for ref in ("plain (batched)", "plain (batched), no cuDNN SDPA"):
                if by_name.get(ref) and row.get("tokens_per_second"):
                    row[f"vs {ref}"] = round(row["tokens_per_second"] / by_name[ref], 2)
            print(f"  B={size} {row}", flush=True)
        found[size] = {"results": results, "per_call": rows}
    return {"new_tokens": new_tokens, "rounds": rounds, "batches": found}


def methods_in_memory(draft) -> dict:
    return {"plain": {}, "assisted (Transformers)": {"assistant_model": draft},
            **{name: {"assistant_model": draft, "speculation": name}
               for name in ("chain", "sequoia", "specexec", "staged")}}


def offload(target) -> torch.nn.Module:
    """The target's layers in CPU RAM, its embedding, norm and output layer on the GPU (accelerate hooks)."""
    from accelerate import dispatch_model

    target.cpu()
    torch.cuda.empty_cache()
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0,
                  **{f"model.layers.{i}": "cpu" for i in range(target.config.num_hidden_layers)}}
    return dispatch_model(target, device_map=device_map, main_device=0)


def replot(folder: Path) -> None:
    """latency.png from latency.json (the four curves: target and draft, sdpa and eager) and steps.png from
    steps.json, whichever the folder holds; the GPU in the caption."""
    if (folder / "steps.json").exists():
        plot_steps(folder)
    if not (folder / "latency.json").exists():
        return
    from latency_curves import plot

    data = json.loads((folder / "latency.json").read_text())
    curves = {f"Qwen2.5-{'7B' if role == 'target' else '0.5B'} shape, bf16, {attn}":
              {"sizes": [int(n) for n in times], "ms": [1e3 * t for t in times.values()]}
              for label, times in data["curves_seconds"].items() for role, attn in [label.split()]}
    env = data["environment"]
    plot(curves, env, folder / "latency.png",
         caption=f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, transformers {env['transformers']}; "
                 "random weights, 256 cached tokens")


def plot_steps(folder: Path) -> None:
    """steps.png from steps.json: per method, a step's milliseconds split into the target's passes, the draft's and
    the rest (the engine and its waits), with tokens/s and tokens per step beside each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((folder / "steps.json").read_text())
    rows = [r for r in data["results"] if "wall_ms_per_step" in r]
    names = [r["method"] for r in rows]
    target = [r["target_host_ms_per_pass"] for r in rows]  # one target pass a step
    draft = [r["draft_host_ms_per_pass"] * r["draft_passes_per_step"] for r in rows]
    outside = [r["outside_passes_ms_per_step"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.6))
    ax.barh(names, target, label="target pass")
    ax.barh(names, draft, left=target, label="draft passes")
    ax.barh(names, outside, left=[t + d for t, d in zip(target, draft)], label="outside the passes")
    for i, r in enumerate(rows):
        label = f"{r['tokens_per_second']:.0f} tok/s, {r['tokens_per_step']:.2f} tok/step"
        ax.text(r["wall_ms_per_step"] + 0.5, i, label, va="center", fontsize=8)
    env = data["environment"]
    ax.set_xlabel("ms per step (host time; medians over calls)")
    ax.set_xlim(0, 1.45 * max(r["wall_ms_per_step"] for r in rows))
    ax.invert_yaxis()
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"Where a step's time goes: {env.get('gpu', env['device'])}, torch {env['torch']}, "
                 f"{data['new_tokens']} tokens, {data['prompts']} prompts × {data['rounds']} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "steps.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--replot", action="store_true", help="Only draw latency.png from the --output folder.")
    parser.add_argument("--deadline", type=float, default=480.0, help="Seconds for the whole run.")
    parser.add_argument("--phases", nargs="*",
                        default=["correctness", "syncs", "latency", "overhead", "memory", "static", "steps",
                                 "batches", "offloaded"])
    parser.add_argument("--explicit", action="store_true",
                        help="In memory, also methods at fixed sizes (chain 8/16 tokens, specexec budgets 16-256).")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--agreement", type=float, default=0.8)
    parser.add_argument("--sharpen", type=float, default=1.0,
                        help="Scale the shared output layer: peaked distributions, as a trained pair has.")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of the steps phase (methods interleaved).")
    parser.add_argument("--smoke", action="store_true", help="Small shapes on any device: a check of this script.")
    parser.add_argument("--only", nargs="*", default=None,
                        help="The step-parts and batches phases time only these rows of their tables (e.g. plain "
                             "chain sequoia).")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    if args.replot:
        return replot(args.output)
    run = Run(args)
    print(json.dumps(environment(run.device)), flush=True)
    for phase, needs in (("correctness", 60), ("syncs", 20)):
        if phase in args.phases and run.left() > needs:
            print(f"== {phase}", flush=True)
            globals()[phase](run)
    big = bool({"latency", "overhead", "memory", "steps", "static", "batches", "offloaded"} & set(args.phases))
    if not big or run.left() < 60:
        return
    print("== models", flush=True)
    target = random_model(SMOKE_TARGET if args.smoke else QWEN_7B, run, torch.bfloat16, 0)
    small = random_model(SMOKE_DRAFT if args.smoke else QWEN_05B, run, torch.bfloat16, 1)
    if "latency" in args.phases:
        print("== latency", flush=True)
        run.write("latency", latency(run, target, small))
    if "overhead" in args.phases:
        print("== pass costs", flush=True)
        run.write("overhead", {"target": pass_costs(run, target, "7B-shaped target"),
                               "draft": pass_costs(run, small, "0.5B-shaped draft")})
    del small
    layers = args.draft_layers
    draft = early_layer_draft(target, layers)
    generator = torch.Generator().manual_seed(11)
    vocab = target.config.vocab_size
    probe = torch.randint(3, vocab, (1, 256), generator=generator).to(run.device)
    tuned = tune_agreement(target, draft, layers, args.agreement, probe)
    with torch.no_grad():
        target.lm_head.weight.mul_(args.sharpen)  # argmax unchanged: the agreement stays as tuned
    prompts = [torch.randint(3, vocab, (1, 64), generator=generator).to(run.device) for _ in range(2)]
    pair = {"target": "Qwen2.5-7B shape, random, bfloat16, sdpa",
            "draft": f"the target's first {layers} layers (shared weights)", "residual_scales": tuned,
            "output_layer_scale": args.sharpen}
    if "memory" in args.phases and run.left() > 90:
        print("== speed in memory", flush=True)
        new = 32 if args.smoke else args.new_tokens
        table = methods_in_memory(draft)
        if args.explicit:
            table.update({f"chain {k} tokens": {"assistant_model": draft,
                                                 "speculation": fixed_chain(k)} for k in (8,)})
            table.update({f"specexec budget {b}": {"assistant_model": draft, "speculation": SpecExecConfig(budget=b)}
                          for b in (16, 64, 256)})
        run.write("memory", {"pair": pair, "new_tokens": new,
                             "results": speed(run, target, draft, table, prompts, new, 2)})
    if "static" in args.phases and run.left() > 90:
        print("== static cache, compiled", flush=True)
        run.write("static", {"pair": pair, **static_speed(run, target, draft, prompts, 32 if args.smoke else 64)})
    if "steps" in args.phases and run.left() > 60:
        print("== step parts", flush=True)
        run.write("steps", {"pair": pair, **step_parts(run, target, draft, prompts, 32 if args.smoke else 64,
                                                        args.rounds)})
    if "batches" in args.phases and run.left() > 90:
        print("== batches", flush=True)
        run.write("batches", {"pair": pair, **batch_speed(run, target, draft, 32 if args.smoke else 64,
                                                          (1, 2) if args.smoke else tuple(args.batch_sizes))})
    if "offloaded" in args.phases and run.device.type == "cuda" and run.left() > 90:
        print("== offloaded", flush=True)
        try:
            offloaded(run, target, draft, pair, prompts)
        except Exception as exc:  # what failed comes back with the rest
            run.write("offloaded", {"pair": pair, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            raise


def offloaded(run: Run, target, draft, pair: dict, prompts) -> None:
    args = run.args
    draft = copy.deepcopy(draft)  # its own copy on the GPU before the target's layers leave
    target = offload(target)
    curve = measure_latency(target, [1, 64, 512, 2048] if not args.smoke else [1, 16], repeats=1, progress=False,
                            stop_ratio=None)
    print(f"  offloaded target: {dict(zip(curve.sizes, curve.seconds))}", flush=True)
    new = 16 if args.smoke else 48
    table = {"plain (offloaded)": {"new_tokens": new // 4},  # the slow one: a quarter of the tokens
             "assisted (Transformers, offloaded)": {"assistant_model": draft},
             **{f"specexec budget {b}": {"assistant_model": draft, "speculation": SpecExecConfig(budget=b)}
                for b in (256, 1024, 2048)}}
    results = speed(run, target, draft, table, prompts[:1], new, 1, warm_up=False)  # a pass costs seconds here
    run.write("offloaded", {"pair": pair, "new_tokens": new, "target_curve_seconds": curve.to_dict(),
                            "results": results})


if __name__ == "__main__":
    main()
