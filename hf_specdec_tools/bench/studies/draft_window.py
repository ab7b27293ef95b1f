"""Does the draft need the whole prompt? Agreement with the target when the draft sees only its last W tokens.

    python -m hf_specdec_tools.bench.studies.draft_window --output benchmarks/results/zen3/kernels/draft-window.json

The int8 draft's pass over a long prompt costs far more than its one-token passes suggest (2.2-2.3 s over 360
tokens on Zen 3, 28% of the float32 target's pass over them, where a one-token draft pass is 0.12-0.16 of the
target's), and both Transformers' assisted loop and ours pay it in every call. A draft that is given only the prompt's
last W tokens would pay a pass over W; the output stays the target's (only the draft changes). This measures what
that costs in agreement, teacher-forced: for each code-continuation prompt (`code_prompts`, cut from this Python's
standard library), the file's next `--tokens` tokens are appended; the target runs once over the whole text; the draft
runs over the prompt's last W tokens plus the same continuation; the agreement is the share of continuation
positions where the draft's argmax is the target's. Counts do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import warnings
from pathlib import Path

import torch

from hf_specdec import quantize_draft
from hf_specdec_tools import models
from hf_specdec_tools.bench.environment import collect_environment
from hf_specdec_tools.prompts import CODE_MODULES, code_prompts

WINDOWS = (32, 64, 128, 256, None)  # None: the whole prompt


def continuation(prompt: str, characters: int = 1500) -> str:
    """The text that follows `prompt` in the standard-library module it was cut from."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CODE_MODULES:
        path = stdlib / name
        source = path.read_text(encoding="utf-8") if path.is_file() else ""
        if prompt in source:
            start = source.index(prompt) + len(prompt)
            return source[start : start + characters]
    raise ValueError("prompt not found in the standard library's modules")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="continuation tokens scored per prompt")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    target, draft, tokenizer = models.load_default_pair(dtype=torch.float32, progress=False)
    draft = quantize_draft(draft, scheme="dynamic-int8")
    rows = []
    with torch.no_grad():
        for prompt in code_prompts(args.prompts):
            prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
            next_ids = tokenizer(continuation(prompt), return_tensors="pt").input_ids[:, : args.tokens]
            whole = torch.cat([prompt_ids, next_ids], 1)
            wanted = target(input_ids=whole).logits[0, prompt_ids.shape[1] - 1 : -1].argmax(-1)
            row = {"prompt_tokens": prompt_ids.shape[1], "agreement": {}}
            for window in WINDOWS:
                ids = torch.cat([prompt_ids[:, -window:] if window else prompt_ids, next_ids], 1)
                got = draft(input_ids=ids).logits[0, ids.shape[1] - next_ids.shape[1] - 1 : -1].argmax(-1)
                row["agreement"][str(window or "whole")] = round(float((got == wanted).float().mean()), 4)
            print(row, flush=True)
            rows.append(row)
    means = {key: round(statistics.mean(r["agreement"][key] for r in rows), 4) for key in rows[0]["agreement"]}
    print("mean agreement by window:", means)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"environment": collect_environment(), "tokens": args.tokens,
                                       "mean_agreement": means, "prompts": rows}, indent=1))


if __name__ == "__main__":
    main()
