"""Plan: the tree a step drafts. Shapes (chain, per-level widths) and Sequoia's planned optimum for an acceptance
vector, sizes against measured latency, the per-step cost models and guard; and calibration: measure a pair's
acceptance and latency, plan the Sequoia tree, store plans, and find the plan a call should use
(`plan_lookup.plan_for_call`, which the integration runs for configs that ask for a plan)."""

from .acceptance import AcceptanceEstimate, estimate_acceptance, rank_acceptance
from .calibrate import calibrate, measure_profile, sampling_processors
from .plan_file import SequoiaPlan, model_fingerprint
from .plan_lookup import call_temperature, plan_for_call
from .sequoia import TreePlan, expected_tokens, expected_tokens_table, plan_tree, validate_acceptance
from .shapes import chain_parents, validate_parents, widths_parents
from .store import find_plan, save_user_plan, user_plan_dir

__all__ = [
    "AcceptanceEstimate",
    "SequoiaPlan",
    "TreePlan",
    "calibrate",
    "call_temperature",
    "chain_parents",
    "estimate_acceptance",
    "expected_tokens",
    "expected_tokens_table",
    "find_plan",
    "measure_profile",
    "model_fingerprint",
    "plan_for_call",
    "plan_tree",
    "rank_acceptance",
    "sampling_processors",
    "save_user_plan",
    "user_plan_dir",
    "validate_acceptance",
    "validate_parents",
    "widths_parents",
]
