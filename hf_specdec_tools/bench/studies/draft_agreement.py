"""How often each way of running the draft picks the target's greedy token, and what its pass costs.

    python -m hf_specdec_tools.bench.studies.draft_agreement \
        --output benchmarks/results/zen3/kernels/draft-agreement.json

Teacher-forced over HumanEval prompts with their canonical solutions (12 by default): one pass of the target and one
of each draft variant over the whole text; the agreement is the share of the solution's positions where the draft's
argmax equals the target's (what a greedy chain's acceptance rests on). Variants: the float32 draft, today's
`quantize_draft` (dynamic int8 on every Linear), dynamic int8 with the Linear layers whose inputs reach the largest
magnitudes on calibration text kept in float32 (the down projections of a few layers and the output layer: a
per-tensor activation scale spends its 8 bits on those outliers), every down projection kept in float32, int4
weight-only. Pass times: one-row and four-row passes after 256 cached tokens, median of 5. Counts do not depend on
the machine's load; the pass times do (run it alone).

    .venv/bin/python -m hf_specdec_tools.bench.studies.draft_agreement --drop-layers 4 \
        --output benchmarks/results/zen3/kernels/dropped-layers.json

`--drop-layers K` measures the int8 draft with decoder layers left out instead (self-speculation's layer skipping
applied to the draft): every single layer dropped is scored on 12 other HumanEval problems (21-32), and the 1..K
layers that scored best are then dropped together and measured as above on the evaluation problems.

    .venv/bin/python -m hf_specdec_tools.bench.studies.draft_agreement --drafts /tmp/distilled \
        --output benchmarks/results/zen5/draft-distill-agreement.json

`--drafts FOLDER...` compares the embedded draft with drafts saved in folders (`draft_distill.py` writes them),
all in float32: greedy agreement as above, and the sampled overlap at T = 0.7, the mean over positions of
sum_x min(p(x), q(x)) (the chance a token the draft samples passes the target's exact check), on the HumanEval
solutions and on the first `--problems` code prompts continued by the 1,500 characters of their module that follow.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import statistics
import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.ao.quantization import quantize_dynamic
from transformers import AutoModelForCausalLM

from hf_specdec import quantize_draft
from hf_specdec.plan.latency import measure_latency
from hf_specdec_tools import models
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.prompts import CODE_MODULES, _humaneval_problems, code_prompts, held_out_corpus


def input_maxima(model: torch.nn.Module, texts: list[torch.Tensor]) -> dict[str, float]:
    """The largest input magnitude each Linear layer sees over `texts`."""
    maxima: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(_module, args, name=name):
                maxima[name] = max(maxima.get(name, 0.0), float(args[0].detach().abs().amax()))
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        for ids in texts:
            model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return maxima


def int8_except(draft: torch.nn.Module, keep: set[str]) -> torch.nn.Module:
    """Dynamic int8 on every Linear but those named in `keep` (left in float32)."""
    model = torch.nn.Module.float(copy.deepcopy(draft)).eval()
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in keep}
    return quantize_dynamic(model, names, dtype=torch.qint8, inplace=True)


def agreement(model: torch.nn.Module, texts: list[torch.Tensor], wanted: list[torch.Tensor],
              starts: list[int]) -> float:
    """Mean share of solution positions where `model`'s argmax is the target's (`wanted`)."""
    shares = []
    with torch.no_grad():
        for ids, target_tokens, start in zip(texts, wanted, starts):
            tokens = model(input_ids=ids).logits[0].argmax(-1)
            shares.append(float((tokens[start - 1 : -1] == target_tokens[start - 1 : -1]).float().mean()))
    return statistics.mean(shares)


def overlap(model: torch.nn.Module, texts: list[torch.Tensor], target_logits: list[torch.Tensor], starts: list[int],
            temperature: float) -> float:
    """Mean over solution positions of sum_x min(p(x), q(x)) at `temperature`: the chance that a token the draft
    samples is accepted by the target's exact check (what a sampled chain's acceptance rests on)."""
    shares = []
    with torch.no_grad():
        for ids, logits, start in zip(texts, target_logits, starts):
            q = torch.softmax(model(input_ids=ids).logits[0, start - 1 : -1].float() / temperature, -1)
            p = torch.softmax(logits[start - 1 : -1] / temperature, -1)
            shares.append(float(torch.minimum(p, q).sum(-1).mean()))
    return statistics.mean(shares)


def code_texts(tokenizer, count: int) -> tuple[list[torch.Tensor], list[int]]:
    """The first `count` code prompts with the 1,500 characters of their module that follow (the held-out function's
    body and on), and where each continuation starts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [(stdlib / name).read_text(encoding="utf-8") for name in CODE_MODULES]
    texts, starts = [], []
    for prompt in code_prompts(count):
        source = next(text for text in sources if prompt in text)
        start = source.index(prompt)
        texts.append(tokenizer(source[start : start + len(prompt) + 1500], return_tensors="pt").input_ids)
        starts.append(tokenizer(prompt, return_tensors="pt").input_ids.shape[1])
    return texts, starts


def distilled_variants(draft: torch.nn.Module, folders: list[str]) -> dict[str, Callable[[], torch.nn.Module]]:
    """The embedded draft and each draft folder given (one `draft_distill.py` wrote), in float32."""
    variants: dict[str, Callable[[], torch.nn.Module]] = {"embedded draft": lambda: draft}
    for folder in folders:
        variants[folder] = lambda folder=folder: AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).eval()
    return variants


def without_layers(draft: torch.nn.Module, layers: list[torch.nn.Module], dropped: set[int]) -> torch.nn.Module:
    """`draft` running only the decoder layers not in `dropped` (each keeps its cache slot by its own index)."""
    draft.model.layers = torch.nn.ModuleList([layer for i, layer in enumerate(layers) if i not in dropped])
    return draft


def target_argmax(target: torch.nn.Module, texts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The target's greedy token at every position of each text."""
    with torch.no_grad():
        return [target(input_ids=ids).logits[0].argmax(-1) for ids in texts]


def dropped_layer_variants(draft: torch.nn.Module, target: torch.nn.Module, tokenizer,
                           count: int) -> tuple[dict[str, Callable[[], torch.nn.Module]], dict[str, float]]:
    """Variants of the int8 draft without its 1..`count` least-missed layers, and each single layer's agreement
    without it on problems 21-32 (what chose them)."""
    quantized = quantize_draft(draft, scheme="dynamic-int8")
    layers = list(quantized.model.layers)
    problems = _humaneval_problems()[20:32]
    texts = [tokenizer(p["prompt"] + p["canonical_solution"], return_tensors="pt").input_ids for p in problems]
    starts = [tokenizer(p["prompt"], return_tensors="pt").input_ids.shape[1] for p in problems]
    wanted = target_argmax(target, texts)
    scores = {i: agreement(without_layers(quantized, layers, {i}), texts, wanted, starts) for i in range(len(layers))}
    print("one layer dropped, agreement on problems 21-32:", {i: round(a, 4) for i, a in scores.items()}, flush=True)
    best = sorted(scores, key=scores.get, reverse=True)
    variants = {"dynamic-int8": lambda: without_layers(quantized, layers, set())}
    for k in range(1, count + 1):
        dropped = set(best[:k])
        variants[f"dynamic-int8 without layers {sorted(dropped)}"] = (
            lambda dropped=dropped: without_layers(quantized, layers, dropped))
    return variants, {str(i): round(a, 4) for i, a in scores.items()}


def kernel_variants(draft: torch.nn.Module, tokenizer) -> tuple[dict[str, Callable[[], torch.nn.Module]], dict]:
    """The draft's quantization variants, and the Linear layers with the largest inputs on calibration text (what
    the mixed variants keep in float32)."""
    calibration = [tokenizer(text[:6000], return_tensors="pt").input_ids[:, :512] for text in held_out_corpus()[:8]]
    maxima = sorted(((value, name) for name, value in input_maxima(draft, calibration).items()), reverse=True)
    downs = {name for _, name in maxima if name.endswith("down_proj")}
    variants = {
        "float32": lambda: draft,
        "dynamic-int8": lambda: quantize_draft(draft, scheme="dynamic-int8"),
        "dynamic-int8, 2 largest-input layers float32": lambda: int8_except(draft, {n for _, n in maxima[:2]}),
        "dynamic-int8, 4 largest-input layers float32": lambda: int8_except(draft, {n for _, n in maxima[:4]}),
        "dynamic-int8, every down_proj float32": lambda: int8_except(draft, downs),
        "int4": lambda: quantize_draft(draft, scheme="int4"),
    }
    return variants, {"largest_inputs": [[n, round(v, 1)] for v, n in maxima[:8]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=12)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--drop-layers", type=int, default=0, metavar="K",
                        help="measure the int8 draft without its 1..K least-missed decoder layers instead")
    parser.add_argument("--drafts", nargs="+", metavar="FOLDER",
                        help="measure the embedded float32 draft against these draft folders instead "
                             "(draft_distill.py's): greedy and sampled (T = 0.7) agreement, HumanEval and code")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    target, draft, tokenizer = models.load_default_pair(dtype=torch.float32, progress=False)
    problems = _humaneval_problems()[: args.problems]
    texts = [tokenizer(p["prompt"] + p["canonical_solution"], return_tensors="pt").input_ids for p in problems]
    starts = [tokenizer(p["prompt"], return_tensors="pt").input_ids.shape[1] for p in problems]
    wanted = target_argmax(target, texts)
    if args.drafts:
        measure_drafts(target, draft, tokenizer, texts, starts, args)
        return
    if args.drop_layers:
        variants, selection = dropped_layer_variants(draft, target, tokenizer, args.drop_layers)
        found = {"selection_agreement": selection}
    else:
        variants, found = kernel_variants(draft, tokenizer)
    del target
    rows = {}
    for name, build in variants.items():
        model = build()
        share = agreement(model, texts, wanted, starts)
        curve = measure_latency(model, (1, 4), past_length=256, repeats=5, progress=False, stop_ratio=None)
        rows[name] = {"agreement": round(share, 4),
                      "ms_per_pass": {n: round(s * 1000, 1) for n, s in zip(curve.sizes, curve.seconds)}}
        print(name, rows[name], flush=True)
        del model
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the float32 copies' heap back before the next variant
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"environment": collect_environment(), "problems": args.problems,
                                       **found, "variants": rows}, indent=1))


def measure_drafts(target, draft, tokenizer, texts, starts, args) -> None:
    """Greedy agreement and sampled overlap (T = 0.7) of each draft, on HumanEval solutions and code continuations."""
    sets = {"humaneval": (texts, starts), "code": code_texts(tokenizer, args.problems)}
    with torch.no_grad():
        logits = {name: [target(input_ids=ids).logits[0].float() for ids in t] for name, (t, _) in sets.items()}
    del target
    rows = {}
    for name, build in distilled_variants(draft, args.drafts).items():
        model = build()
        rows[name] = {}
        for which, (t, s) in sets.items():
            wanted = [row.argmax(-1) for row in logits[which]]
            rows[name][which] = {"greedy": round(agreement(model, t, wanted, s), 4),
                                 "sampled_T0.7": round(overlap(model, t, logits[which], s, 0.7), 4)}
        print(name, rows[name], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"environment": collect_environment(), "problems": args.problems,
                                       "variants": rows}, indent=1))


if __name__ == "__main__":
    main()
