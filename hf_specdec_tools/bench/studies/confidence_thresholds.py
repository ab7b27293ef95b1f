"""Chains stopped where the draft is unsure, with the threshold fixed or learned during the call: Transformers'
assisted generation with scikit-learn hidden (its `assistant_confidence_threshold` stays 0.4) and installed (it is
re-fitted every step on the ROC of the draft's probabilities against the verdicts), our `chain` with
`adapt_threshold` True and False (from 0.4), our `chain` at its default (sized every step by the cost model), and
`specexec`; the embedded pair, greedy, one HumanEval prompt after another, every variant right after plain on the
same prompt.

    .venv/bin/pip install scikit-learn   # what Transformers needs to learn its threshold (not a dependency here)
    .venv/bin/python -m hf_specdec_tools.bench.studies.confidence_thresholds --prompts 4 \
        --output benchmarks/results/zen3/confidence-thresholds

Reports per variant: the median over prompts of plain's seconds / the variant's, tokens per target pass (the
prompt's pass counted, as `generate` runs it) and draft passes per new token (forward hooks on both models), and
whether every output is plain's. Writes rows.json (every call) and README.md (the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.generation import candidate_generator

import hf_specdec
from hf_specdec.plan import guard
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.models import load_default_pair
from hf_specdec_tools.prompts import humaneval_prompts

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def variants(draft) -> dict[str, tuple[bool, dict]]:
    """name -> (whether Transformers may see scikit-learn, generate's keyword arguments)."""
    chain = dict(assistant_model=draft, speculation="chain")
    return {
        "plain": (True, {}),
        "hf-assisted, threshold fixed (no scikit-learn)": (False, dict(assistant_model=draft)),
        "hf-assisted, threshold learned (scikit-learn)": (True, dict(assistant_model=draft)),
        "chain, threshold learned": (True, {**chain, "speculation_config": {"confidence_threshold": 0.4,
                                                                            "adapt_threshold": True}}),
        "chain, threshold fixed": (True, {**chain, "speculation_config": {"confidence_threshold": 0.4}}),
        "chain, sized every step (default)": (True, chain),
        "specexec": (True, dict(assistant_model=draft, speculation="specexec")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval prompts 0..N-1")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    try:
        import sklearn  # noqa: F401
    except ImportError:
        parser.error("Transformers learns its threshold only with scikit-learn: pip install scikit-learn")
    target, draft, tokenizer = load_default_pair(torch.float32, progress=False)
    hf_specdec.prepack(target)
    draft = hf_specdec.quantize_draft(draft)
    passes = {"target": 0, "draft": 0}
    target.register_forward_hook(lambda *_: passes.__setitem__("target", passes["target"] + 1))
    draft.register_forward_hook(lambda *_: passes.__setitem__("draft", passes["draft"] + 1))
    learns = candidate_generator.is_sklearn_available
    rows, named = [], variants(draft)
    for index, prompt in enumerate(humaneval_prompts(args.prompts)):
        ids = tokenizer(prompt, return_tensors="pt")
        reference = None
        for name, (sklearn_seen, kwargs) in named.items():
            candidate_generator.is_sklearn_available = learns if sklearn_seen else (lambda: False)
            guard._REMEMBERED.clear()  # every call judged afresh, not by the one before it
            passes.update(target=0, draft=0)
            start = time.perf_counter()
            out = target.generate(**ids, max_new_tokens=args.new_tokens, do_sample=False, **kwargs)
            seconds = time.perf_counter() - start
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            reference = sequences if reference is None else reference
            rows.append(dict(prompt=index, variant=name, seconds=seconds,
                             tokens=sequences.shape[1] - ids["input_ids"].shape[1], target_passes=passes["target"],
                             draft_passes=passes["draft"], identical=bool(torch.equal(sequences, reference))))
            print(rows[-1], flush=True)
    candidate_generator.is_sklearn_available = learns
    machine = {"cpu": cpu_model(), "flags": [f for f in FLAGS if f in cpu_flags()],
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "rows.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [f"{machine['cpu']} ({', '.join(machine['flags'])}), {machine['threads']} threads, torch "
             f"{machine['torch']}; float32 prepacked target, int8 draft, greedy, HumanEval 0-{args.prompts - 1} x "
             f"{args.new_tokens} tokens.", "",
             "| variant | speedup (median; per prompt) | tokens / target pass | draft passes / token | identical |",
             "|---|---|---|---|---|"]
    for name in named:
        mine = [row for row in rows if row["variant"] == name]
        plain = {row["prompt"]: row["seconds"] for row in rows if row["variant"] == "plain"}
        ratios = [plain[row["prompt"]] / row["seconds"] for row in mine]
        lines.append(f"| {name} | {statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)}) | "
                     f"{sum(r['tokens'] for r in mine) / sum(r['target_passes'] for r in mine):.2f} | "
                     f"{sum(r['draft_passes'] for r in mine) / sum(r['tokens'] for r in mine):.2f} | "
                     f"{sum(r['identical'] for r in mine)}/{len(mine)} |")
    (args.output / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
