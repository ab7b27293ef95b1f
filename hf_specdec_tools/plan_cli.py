"""`hf-specdec plan`: print the Sequoia-optimal tree for an acceptance vector."""

from __future__ import annotations

import argparse
import sys
import time

from hf_specdec.methods.sequoia.dp import plan_tree


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` command to the `hf-specdec` sub-command parsers."""
    parser = subparsers.add_parser(
        "plan",
        help="Plan the Sequoia-optimal tree shape for an acceptance vector.",
        description=(
            "Find the tree of at most BUDGET nodes and MAX_DEPTH levels (both counting the root) that maximises the "
            "expected tokens per target step, when the r-th drafted child of a node is accepted with probability P_r."
        ),
    )
    parser.add_argument(
        "--acceptance", required=True, metavar="P1,P2,...",
        help="Comma-separated acceptance probability of the 1st, 2nd, ... drafted child; each in [0, 1], sum <= 1.",
    )
    parser.add_argument("--budget", required=True, type=int, metavar="N", help="Max nodes, root included (>= 1).")
    parser.add_argument("--max-depth", required=True, type=int, metavar="D", help="Max levels, root included (>= 1).")
    parser.add_argument("--json", action="store_true", help="Print exactly one JSON object instead of a summary.")
    parser.add_argument("--output", metavar="FILE", help="Also save the plan as JSON (load it with TreePlan.load).")
    parser.set_defaults(func=run)
    return parser


def _parse_acceptance(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--acceptance must be comma-separated numbers such as 0.6,0.2,0.1, got {text!r}."
        ) from None


def run(args: argparse.Namespace) -> int:
    """Plan, print, optionally save; returns 2 with a message on stderr for bad inputs."""
    try:
        acceptance = _parse_acceptance(args.acceptance)
        if args.budget < 1:
            raise ValueError(f"--budget counts tree nodes including the root, so it must be >= 1, got {args.budget}.")
        if args.max_depth < 1:
            raise ValueError(f"--max-depth counts levels including the root, so it must be >= 1, got {args.max_depth}.")
        start = time.perf_counter()
        plan = plan_tree(acceptance, args.budget, args.max_depth)
        seconds = time.perf_counter() - start
    except ValueError as exc:
        print(f"hf-specdec plan: error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        plan.save(args.output)
    if args.json:
        print(plan.to_json())
        return 0
    widths = plan.widths_per_level()
    print(f"Sequoia tree for acceptance {plan.acceptance} (planned in {seconds:.2f} s)")
    print(f"  nodes:           {len(plan.parents)} of budget {plan.budget} (root included)")
    print(f"  levels:          {len(widths)} of max depth {plan.max_depth} (root included)")
    print(f"  nodes per level: {widths}")
    print(f"  expected tokens per target step: {plan.expected_tokens:.4f}")
    print(f"  parents: {plan.parents}")
    if args.output:
        print(f"  saved to {args.output}")
    return 0
