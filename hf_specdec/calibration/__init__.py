"""Calibration: measure a pair's acceptance and latency, plan the Sequoia tree, store and find plans."""

from .acceptance import AcceptanceEstimate, estimate_acceptance, rank_acceptance
from .calibrate import calibrate, measure_profile, sampling_processors
from .plan_file import SequoiaPlan, model_fingerprint
from .store import find_plan, save_user_plan, user_plan_dir

__all__ = [
    "AcceptanceEstimate",
    "SequoiaPlan",
    "calibrate",
    "estimate_acceptance",
    "find_plan",
    "measure_profile",
    "model_fingerprint",
    "rank_acceptance",
    "sampling_processors",
    "save_user_plan",
    "user_plan_dir",
]
