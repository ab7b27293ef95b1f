"""A llama.cpp reference row: the same prompts, greedy, on the GGUF file the embedded target was converted from.

A CPU user weighs us against llama.cpp, not only against plain Transformers. The row runs in the same process after
the Transformers strategies, through llama-cpp-python (the optional extra `pip install -e ".[llamacpp]"`), with the
same token ids, thread count and new-token budget, and reports tokens per second and its ratio to plain `generate`.
Its outputs are not compared: llama.cpp multiplies the 4-bit blocks itself, so its greedy path is its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

LABEL = "llama.cpp"
INSTALL_HINT = 'install the optional extra: pip install -e ".[llamacpp]" (builds llama.cpp once, a few minutes)'


def unavailable() -> str | None:
    """Why the row cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    return None


def reference_strategy(gguf: Path) -> dict[str, Any]:
    """The row's entry in results.json's strategy list."""
    return {"label": LABEL, "name": LABEL, "kind": "reference", "settings": {"gguf": gguf.name}, "uses_draft": False}


def run_llama_cpp(gguf: Path, prompts: list[torch.LongTensor], max_new_tokens: int, seed: int = 0,
                  warmup_tokens: int = 8, progress: bool = True) -> list[dict[str, Any]]:
    """One greedy call per prompt (after one short warm-up call; repeats are not applied): records shaped like the
    bench's own calls."""
    from llama_cpp import Llama

    longest = max(int(ids.shape[1]) for ids in prompts) + max_new_tokens
    model = Llama(model_path=str(gguf), n_ctx=longest + 8, n_threads=torch.get_num_threads(),
                  n_threads_batch=torch.get_num_threads(), seed=seed, verbose=False)
    try:
        _greedy(model, prompts[0][0].tolist(), warmup_tokens)
        calls = []
        for index, input_ids in enumerate(tqdm(prompts, desc=LABEL, unit="prompt", disable=not progress)):
            start = time.perf_counter()
            new_tokens = _greedy(model, input_ids[0].tolist(), max_new_tokens)
            seconds = time.perf_counter() - start
            calls.append({
                "prompt": index, "repeat": 0, "strategy": LABEL, "prompt_tokens": int(input_ids.shape[1]),
                "new_tokens": len(new_tokens), "seconds": seconds,
                "tokens_per_s": len(new_tokens) / seconds if seconds > 0 else None, "identical": None,
                "target_passes": 0, "target_prefill_passes": 0, "target_steps": 0, "tokens_per_target_step": None,
                "draft_passes": 0, "draft_passes_per_token": None, "rss_before_bytes": None,
                "peak_rss_delta_bytes": None, "speculation_stats": None,
            })
    finally:
        model.close()
    return calls


def _greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt`, stopping at any end-of-generation token (Qwen has two) as `generate` stops
    at the target's `eos_token_id` list, or after `max_new_tokens`."""
    import llama_cpp

    model.reset()
    tokens = []
    for token in model.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        if llama_cpp.llama_vocab_is_eog(model._model.vocab, token) or len(tokens) >= max_new_tokens:
            break  # the same end-of-generation test llama-cpp-python's own completion loop makes
    return tokens


def version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", None)
