"""The `hf-specdec` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import calibrate_cli, demo, families_cli, ngram_cli, plan_cli
    from .bench import cli as bench_cli
    from .models import cli as models_cli

    parser = argparse.ArgumentParser(
        prog="hf-specdec", description="Tree-structured speculative decoding for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    models_cli.register_cli(subparsers)
    plan_cli.register_cli(subparsers)
    calibrate_cli.register_cli(subparsers)
    demo.register_cli(subparsers)
    bench_cli.register_cli(subparsers)
    ngram_cli.register_cli(subparsers)
    families_cli.register_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
