"""Tree shapes: static ones (chain, per-level widths) and Sequoia's planned optimum for an acceptance vector."""

from .sequoia import TreePlan, expected_tokens, expected_tokens_table, plan_tree, validate_acceptance
from .shapes import chain_parents, validate_parents, widths_parents

__all__ = [
    "TreePlan",
    "chain_parents",
    "expected_tokens",
    "expected_tokens_table",
    "plan_tree",
    "validate_acceptance",
    "validate_parents",
    "widths_parents",
]
