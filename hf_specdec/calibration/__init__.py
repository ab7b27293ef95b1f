"""Calibration: measure a pair's acceptance and latency, plan the Sequoia tree, store plans, and find the plan a
call should use (`plan_lookup.plan_for_call`, which the integration runs for configs that ask for a plan)."""

from .acceptance import AcceptanceEstimate, estimate_acceptance, rank_acceptance
from .calibrate import calibrate, measure_profile, sampling_processors
from .plan_file import SequoiaPlan, model_fingerprint
from .plan_lookup import call_temperature, plan_for_call
from .store import find_plan, save_user_plan, user_plan_dir

__all__ = [
    "AcceptanceEstimate",
    "SequoiaPlan",
    "calibrate",
    "call_temperature",
    "estimate_acceptance",
    "find_plan",
    "measure_profile",
    "model_fingerprint",
    "plan_for_call",
    "rank_acceptance",
    "sampling_processors",
    "save_user_plan",
    "user_plan_dir",
]
