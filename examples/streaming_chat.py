"""Stream a chat reply while it is generated: `TextIteratorStreamer` + `generate` in a thread.

Speculation hands the streamer every accepted block at once, so text arrives in bursts of several tokens.
Run: `python examples/streaming_chat.py`.
"""

from __future__ import annotations

from threading import Thread

import torch
from transformers import TextIteratorStreamer

import hf_specdec  # noqa: F401  (adds `speculation=` to generate)

DEFAULT_MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a linked list."}]


def main(target, draft, tokenizer, messages: list[dict] | None = None, max_new_tokens: int = 128):
    """Print the reply as it streams; returns (streamed text, generate's output with `speculation_stats`)."""
    ids = tokenizer.apply_chat_template(
        messages or DEFAULT_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict = {}

    def run() -> None:
        try:
            result["out"] = target.generate(
                ids,
                assistant_model=draft,
                speculation="tree",
                streamer=streamer,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
            )
        except BaseException as error:  # unblock the reader below, then re-raise in the main thread
            result["error"] = error
            streamer.end()

    thread = Thread(target=run)
    thread.start()
    pieces = []
    for piece in streamer:
        print(piece, end="", flush=True)
        pieces.append(piece)
    thread.join()
    print()
    if "error" in result:
        raise result["error"]
    stats = result["out"].speculation_stats
    print(f"[{stats.new_tokens} tokens in {stats.target_forwards} target passes]")
    return "".join(pieces), result["out"]


if __name__ == "__main__":
    from hf_specdec_tools import models

    main(*models.load_default_pair(dtype=torch.bfloat16))
