"""A chat through `pipeline("text-generation")`: the pipeline forwards `speculation=` to `generate`.

`assistant_model=` is a pipeline argument of its own; `speculation=` (and `speculation_config=`) can be given
when the pipeline is built, as here, or on each call. Chat messages go through the tokenizer's chat template.
Run: `python examples/pipeline_chat.py`.
"""

from __future__ import annotations

import torch
from transformers import pipeline

import hf_specdec  # noqa: F401  (adds `speculation=` to generate)

DEFAULT_TURNS = [
    "Write a Python function that tells whether a number is prime.",
    "Now add type hints and a one-line docstring.",
]


def main(target, draft, tokenizer, turns: list[str] | None = None, max_new_tokens: int = 128) -> list[dict]:
    """Hold a multi-turn chat, each reply drafted as a tree; returns the whole conversation."""
    chat = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft, speculation="tree")
    messages: list[dict] = [{"role": "system", "content": "You are a concise coding assistant."}]
    for turn in turns or DEFAULT_TURNS:
        messages.append({"role": "user", "content": turn})
        # Greedy, so the reply is the one plain generation gives; drop do_sample=False to sample (also exact).
        result = chat(messages, max_new_tokens=max_new_tokens, do_sample=False)
        messages = result[0]["generated_text"]
        print(f"user: {turn}\nassistant: {messages[-1]['content']}\n")
    return messages


if __name__ == "__main__":
    from hf_specdec_tools import models

    main(*models.load_default_pair(dtype=torch.bfloat16))
