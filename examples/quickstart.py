"""Quick start on the embedded pair: plain greedy vs `speculation="tree"`, same output, fewer target passes."""

import time

import torch

import hf_specdec
from hf_specdec import models

target, draft, tokenizer = models.load_default_pair(dtype=torch.bfloat16)
ids = tokenizer("def quicksort(items):\n", return_tensors="pt").input_ids

start = time.perf_counter()
plain = target.generate(ids, max_new_tokens=64, do_sample=False)
plain_seconds = time.perf_counter() - start

start = time.perf_counter()
out = target.generate(
    ids, assistant_model=draft, speculation="tree", max_new_tokens=64, do_sample=False, return_dict_in_generate=True
)
tree_seconds = time.perf_counter() - start

print(tokenizer.decode(out.sequences[0, ids.shape[1]:]))
print(f"identical to plain: {torch.equal(out.sequences, plain)}")
print(f"speedup: {plain_seconds / tree_seconds:.2f}x, tokens per target step: "
      f"{out.speculation_stats.mean_tokens_per_step:.2f} (hf_specdec {hf_specdec.__version__})")
