"""The prompts a benchmark runs: HumanEval, a text file, or chats rendered with the tokenizer's chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..prompts import chat_prompts, code_prompts, humaneval_prompts, load_prompts, rewrite_chats

Chat = list[dict[str, Any]]
Prompt = str | Chat

HUMANEVAL = "humaneval"
REWRITE = "rewrite"
CODE = "code"
CHAT = "chat"


class PromptError(ValueError):
    """Prompts that cannot be read or tokenized: the message names the problem and the fix."""


def load_prompt_source(spec: str) -> list[Prompt]:
    """`humaneval` (all 164), `humaneval:N` (the first N), `code[:N]` (continuations of functions cut from the
    Python standard library's sources, see `prompts.code_prompts`), `rewrite[:N]` (chats whose answers repeat their
    input: rewrite a HumanEval solution with one rename), `chat[:N]` (general chat: multi-turn, translation,
    summarization, QA, math, a long retrieved context; see `prompts.chat_prompts`), or a `.jsonl` / `.json` / `.txt`
    file."""
    name, _, count = spec.partition(":")
    if name in (HUMANEVAL, REWRITE, CODE, CHAT):
        try:
            number = int(count) if count else None
        except ValueError:
            raise PromptError(f"--prompts {spec!r}: the count after `{name}:` must be an integer.") from None
        if number is not None and number < 1:
            raise PromptError(f"--prompts {spec!r}: ask for at least one prompt.")
        sources = {HUMANEVAL: humaneval_prompts, CODE: code_prompts, REWRITE: rewrite_chats, CHAT: chat_prompts}
        return list(sources[name](number))
    path = Path(spec)
    if not path.is_file():
        raise PromptError(
            f"--prompts {spec!r} is neither `humaneval[:N]`, `code[:N]`, `rewrite[:N]`, `chat[:N]` nor an existing "
            "file: give a "
            '.jsonl (one {"prompt": ...} or {"messages": [...]} per line), a .json list of strings or chats, or a .txt '
            "file."
        )
    prompts = _load_chats(path) or load_prompts(path)
    if not prompts:
        raise PromptError(f"{path} holds no prompts.")
    return prompts


def _load_chats(path: Path) -> list[Chat] | None:
    """Chats from a .json list or .jsonl lines of message lists (or {"messages": [...]}); None if not chats."""
    if path.suffix not in (".json", ".jsonl"):
        return None
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise PromptError(f"{path} is not valid JSON: {error}.") from None
    if not isinstance(items, list) or not items:
        return None
    chats = [item.get("messages") if isinstance(item, dict) and "messages" in item else item for item in items]
    if not all(_is_chat(chat) for chat in chats):
        return None
    return chats


def _is_chat(item: Any) -> bool:
    return (
        isinstance(item, list)
        and bool(item)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in item)
    )


def tokenize_prompts(tokenizer, prompts: list[Prompt]) -> list[torch.LongTensor]:
    """Each prompt as `(1, length)` ids: text as is (code completion), chats through the chat template."""
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
        else:
            if getattr(tokenizer, "chat_template", None) is None:
                raise PromptError(
                    "These prompts are chats but the tokenizer has no chat template: give plain-text prompts, or a "
                    "tokenizer with a chat template."
                )
            ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )["input_ids"]
        if ids.shape[-1] == 0:
            raise PromptError(f"Prompt {index} tokenizes to nothing: remove it or give it some text.")
        encoded.append(ids.long())
    return encoded
