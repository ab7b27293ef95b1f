"""A draft distilled toward its target (DistillSpec, arXiv 2310.08461): LoRA adapters, merged, saved as a folder.

    .venv/bin/pip install peft            # not a dependency of the project: this lever measured no gain
    python -m hf_specdec_tools.bench.studies.draft_distill \
        --output /tmp/distilled                   # about 35 min on Zen 5
    python -m hf_specdec_tools.bench.studies.draft_agreement --drafts /tmp/distilled --output DIR/agreement.json
    .venv/bin/python -m hf_specdec_tools.bench.studies.draft_schemes 0 code 8 tree,specexec mixed mixed=/tmp/distilled

The embedded pair: the target in bfloat16 where that is native (else float32), the draft in float32 with bfloat16
autocast where native. Text: `held_out_corpus()` (disjoint from every benchmark's prompts) cut into consecutive
`--length`-token pieces, `--sequences` of them drawn at random (seed 0). Each step, one piece: the target's top-k
next-token probabilities at every position (renormalised over the k) against the draft's log-probabilities at those
tokens, cross-entropy (forward KL up to a constant); AdamW, linear warm-up over 20 steps then linear decay, LoRA on
every attention and MLP projection. The adapters are merged into the draft's weights, which are saved in the folder's
dtype with the tokenizer: a plain model of the draft's shape that `quantize_draft` and every method take.
"""

from __future__ import annotations

import argparse
import random
import time
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from hf_specdec.runtime.devices import native_bfloat16
from hf_specdec_tools import models
from hf_specdec_tools.prompts import held_out_corpus

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pieces(tokenizer, texts: list[str], length: int) -> list[list[int]]:
    """Consecutive, non-overlapping `length`-token pieces of each text (a shorter tail dropped)."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out += [ids[s : s + length] for s in range(0, len(ids) - length + 1, length)]
    return out


def distill(draft, target, data: list[list[int]], args: argparse.Namespace, compute_dtype) -> list[float]:
    """Train LoRA adapters on `draft` toward `target` over `data`, merge them; the loss of every step."""
    torch.manual_seed(args.seed)
    adapted = get_peft_model(draft, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                               target_modules=PROJECTIONS))
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=args.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 21) * max(0.0, 1 - s / len(data)))
    losses = []
    adapted.train()
    for ids in tqdm(data, desc="distilling the draft", unit="seq"):
        with torch.no_grad():
            values, columns = target(torch.tensor([ids])).logits[0].float().topk(args.top_k, dim=-1)
            probs = torch.softmax(values, dim=-1)
        with torch.autocast("cpu", dtype=compute_dtype, enabled=compute_dtype is not None):
            logits = adapted(torch.tensor([ids])).logits[0]
        loss = -(probs * torch.log_softmax(logits.float(), -1).gather(-1, columns)).sum(-1).mean()
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    adapted.merge_and_unload()
    draft.eval()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=700)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    native = native_bfloat16(False)
    target_folder, draft_folder = models.fetch_default_pair(progress=False)
    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.bfloat16 if native else torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(draft_folder, dtype=torch.float32)
    tokenizer = models.load_tokenizer(models.DEFAULT_DRAFT, progress=False)
    data = pieces(tokenizer, held_out_corpus(), args.length)
    random.Random(args.seed).shuffle(data)
    start = time.perf_counter()
    losses = distill(draft, target.eval(), data[: args.sequences], args, torch.bfloat16 if native else None)
    tenth = max(1, len(losses) // 10)
    saved = AutoConfig.from_pretrained(draft_folder).dtype or torch.float32
    draft.to(getattr(torch, saved) if isinstance(saved, str) else saved).save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"{args.output}: {len(losses)} of {len(data)} pieces x {args.length} tokens in "
          f"{time.perf_counter() - start:.0f} s; loss {sum(losses[:tenth]) / tenth:.3f} over the first tenth, "
          f"{sum(losses[-tenth:]) / tenth:.3f} over the last")


if __name__ == "__main__":
    main()
