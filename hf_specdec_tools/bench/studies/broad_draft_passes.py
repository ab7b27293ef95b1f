"""Whole calls with the "mixed" draft's broadest passes on its bfloat16 copies (`RowDispatchLinear.broad_rows`, as
`quantize_draft` now measures it) against the same draft with them on dynamic int8 (broad_rows 0, as before).

    python -m hf_specdec_tools.bench.studies.broad_draft_passes --output benchmarks/results/xeon-amx/broad-draft.json

The embedded pair as the bench loads it (bfloat16, the target prepacked, the draft "mixed"), greedy, general chat (48
new tokens, the 760-token retrieved context included) and code continuations (64). Per prompt and method, three
calls interleaved (their order reversed every other prompt): plain `generate`, the method with the broad passes on
int8, the method as it is. One warm-up call of each first. Each call's seconds and the draft's pass over the prompt
(the first draft pass of the call, timed by a forward hook) are recorded, and whether its tokens are plain's. A
summary of speedups over plain (median, min) is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec.kernels.row_dispatch import RowDispatchLinear, set_broad_rows
from hf_specdec.runtime.devices import cpu_flags, cpu_model
from hf_specdec_tools.bench.inputs import load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models

SETS = (("chat", 48), ("code:6", 64))
METHODS = ("sequoia", "chain")


class FirstPass:
    """Times a model's first forward pass after `arm()` (the draft's pass over the prompt)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: float | None = None
        self._armed, self._start = False, 0.0
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def arm(self) -> None:
        self.seconds, self._armed = None, True

    def _before(self, *_) -> None:
        if self._armed:
            self._start = time.perf_counter()

    def _after(self, *_) -> None:
        if self._armed:
            self.seconds, self._armed = time.perf_counter() - self._start, False


def run_call(models, ids: torch.Tensor, method: str | None, broad_rows: int, new_tokens: int, clock: FirstPass
             ) -> dict:
    """One greedy call: plain (`method` None) or `method` with the draft's broad passes from `broad_rows` rows."""
    set_broad_rows(models.draft, broad_rows)
    kwargs = {} if method is None else {"assistant_model": models.draft, "speculation": method}
    clock.arm()
    start = time.perf_counter()
    out = models.target.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    seconds = time.perf_counter() - start
    return {"method": method or "plain", "broad_rows": broad_rows, "seconds": seconds,
            "draft_prompt_pass": clock.seconds if method else None, "tokens": out[0, ids.shape[1]:].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    models = load_models(dtype=torch.bfloat16, int8_draft=True, prepack=True, progress=False)
    measured = next(m.broad_rows for m in models.draft.modules() if isinstance(m, RowDispatchLinear))
    clock = FirstPass(models.draft)
    runs = [(None, 0)] + [(method, rows) for method in METHODS for rows in (0, measured)]
    rows = []
    try:
        for source, new_tokens in SETS:
            prompts = tokenize_prompts(models.tokenizer, load_prompt_source(source))
            for method, broad in runs:  # warm-up
                run_call(models, prompts[0], method, broad, 8, clock)
            for index, ids in enumerate(prompts):
                calls = [run_call(models, ids, method, broad, new_tokens, clock)
                         for method, broad in (runs[::-1] if index % 2 else runs)]
                plain = next(call for call in calls if call["method"] == "plain")
                seconds, tokens = plain["seconds"], plain["tokens"]
                for call in calls:
                    call.update(set=source, prompt=index, prompt_tokens=ids.shape[1], speedup=seconds / call["seconds"],
                                same_as_plain=call.pop("tokens") == tokens)
                    print(json.dumps(call), flush=True)
                rows += calls
    finally:
        set_broad_rows(models.draft, measured)
    for source, _ in SETS:
        for method in METHODS:
            for broad in (0, measured):
                picked = [row for row in rows if row["set"] == source and row["method"] == method
                          and row["broad_rows"] == broad]
                speedups = [row["speedup"] for row in picked]
                passes = [row["draft_prompt_pass"] for row in picked if row["draft_prompt_pass"] is not None]
                print(f"{source} {method} broad_rows {broad}: median {statistics.median(speedups):.2f}x plain, "
                      f"min {min(speedups):.2f}x; draft prompt pass median {statistics.median(passes):.3f} s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "machine": {"cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__},
        "measured_broad_rows": measured, "calls": rows}, indent=1))


if __name__ == "__main__":
    main()
