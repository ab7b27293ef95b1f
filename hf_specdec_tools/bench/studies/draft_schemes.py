"""Two ways to quantize the draft, every method, in one process: speedup over plain `generate` per prompt.

    python -m hf_specdec_tools.bench.studies.draft_schemes 0 humaneval 8 chain,sequoia,specexec,staged [int8 mixed]

Arguments: temperature (0: greedy), prompt set (humaneval or code), prompts, methods; then the `quantize_draft`
schemes to compare (default dynamic-int8 and mixed); a scheme written `mixed:model-forward` is that draft run
through the model's own forward (no `kernels/lean_pass.py`), `mixed:unfused` through the lean pass without its fused
int4 calls (`kernels/fused_int4.py`); `mixed@16384` is that draft with its output layer over
the 16,384 tokens most frequent in `held_out_corpus()` (text disjoint from the prompts; `frequent_tokens`);
`mixed=FOLDER` is the draft saved in FOLDER (one `draft_distill.py` wrote, say) quantized that way. The
embedded pair in bfloat16 with the target prepacked; each prompt runs plain, then every method with every draft, in
an order reversed on every other prompt; 64 new tokens, `torch.manual_seed(prompt index)` before each call. Prints
per prompt (tokens/s, tokens per step) and, per method and draft, the median and the lowest speedup over plain, mean
tokens per step and mean ms per draft pass. A first call of each variant on the first prompt is a warm-up (plans
looked up, latency measured) and is not counted.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
import time
import warnings
from unittest import mock

import torch
from transformers import AutoModelForCausalLM

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec import frequent_tokens, prepack, quantize_draft
from hf_specdec.kernels import lean_pass
from hf_specdec.kernels.row_dispatch import RowDispatchLinear
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools import models
from hf_specdec_tools.prompts import code_prompts, held_out_corpus, humaneval_prompts

NAMES = {"int8": "dynamic-int8"}


def main() -> None:
    warnings.filterwarnings("ignore")
    temperature, which, count, methods = float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    schemes = sys.argv[5:] or ["int8", "mixed"]
    print(f"machine: {cpu_model()}, flags {cpu_flags()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    target, draft, tokenizer = models.load_default_pair(dtype=torch.bfloat16, progress=False)
    prepack(target)
    drafts, built = {}, {}
    for scheme in schemes:
        start = time.perf_counter()
        base = scheme.partition(":")[0]
        if base not in built:
            quantized, _, folder = base.partition("=")
            name, _, size = quantized.partition("@")
            vocabulary = frequent_tokens(tokenizer, held_out_corpus(), int(size)) if size else None
            source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval() if folder else draft
            built[base] = quantize_draft(source, vocabulary=vocabulary, scheme=NAMES.get(name, name))
        drafts[scheme] = built[base]
        narrow = next((m.narrow_rows for m in drafts[scheme].modules() if isinstance(m, RowDispatchLinear)), None)
        print(f"{scheme} built in {time.perf_counter() - start:.1f} s" + (f"; int4 up to {narrow} rows" if narrow
                                                                           is not None else ""), flush=True)
    del draft
    prompts = humaneval_prompts(count) if which == "humaneval" else code_prompts(count)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    names = ["plain"] + [f"{method}/{scheme}" for method in methods for scheme in drafts]

    def run(name: str, ids: torch.Tensor, seed: int) -> tuple[float, float, float]:
        torch.manual_seed(seed)
        method, _, scheme = name.partition("/")
        extra = {} if name == "plain" else {"assistant_model": drafts[scheme], "speculation": method}
        variant = scheme.partition(":")[2]
        start = time.perf_counter()
        with contextlib.ExitStack() as switches:
            if variant == "model-forward":
                switches.enter_context(mock.patch.object(lean_pass, "SUPPORTED", ()))
            if variant == "unfused":
                switches.enter_context(mock.patch.object(lean_pass.FusedInt4, "of", lambda linears: None))
            out = target.generate(ids, max_new_tokens=64, return_dict_in_generate=True, **extra, **sampling)
        seconds = time.perf_counter() - start
        stats = getattr(out, "speculation_stats", None)
        per_pass = 1000 * stats.time_draft_forward / stats.draft_forwards if stats and stats.draft_forwards else 0.0
        return (out.sequences.shape[1] - ids.shape[1]) / seconds, stats.mean_tokens_per_step if stats else 1.0, per_pass

    warm = tokenizer(prompts[0], return_tensors="pt").input_ids
    for name in names:
        start = time.perf_counter()
        run(name, warm, 0)
        print(f"warm {name} {time.perf_counter() - start:.1f} s", flush=True)
    speedup, per_step, per_pass = (collections.defaultdict(list) for _ in range(3))
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        order = names if i % 2 == 0 else [names[0], *names[:0:-1]]
        row = {name: run(name, ids, i) for name in order}
        for name, (rate, steps, ms) in row.items():
            speedup[name].append(rate / row["plain"][0])
            per_step[name].append(steps)
            per_pass[name].append(ms)
        print(i, {name: (round(v[0], 2), round(v[1], 2)) for name, v in row.items()}, flush=True)
    for name in names:
        print(f"{name:18s} median speedup {statistics.median(speedup[name]):.3f}  min {min(speedup[name]):.2f}  "
              f"mean tok/step {statistics.mean(per_step[name]):.2f}  "
              f"draft ms/pass {statistics.mean(per_pass[name]):.1f}")


if __name__ == "__main__":
    main()
