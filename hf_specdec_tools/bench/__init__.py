"""`hf-specdec bench`: every strategy against Transformers' own decoding options, in one process.

strategies (what each strategy passes to generate) → runner (interleaved loop, per-call measure) → aggregate
(medians and ratios against plain) → report (results.json, results.md, plots) → readme (README's Results region).
"""

from .aggregate import summarize
from .runner import BenchSettings, run_benchmark
from .strategies import Strategy, StrategyError, known_strategies, parse_strategy, resolve_strategies

__all__ = [
    "BenchSettings",
    "Strategy",
    "StrategyError",
    "known_strategies",
    "parse_strategy",
    "resolve_strategies",
    "run_benchmark",
    "summarize",
]
