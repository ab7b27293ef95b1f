"""`speculation="sequoia"`: its config (`config.py`) and everything Sequoia plans with.

The data path: `calibrate.py` measures the pair's acceptance vector (`acceptance.py`) and latency curves
(`plan/latency.py`); `dp.py` is the DP over tree shapes for that vector; `sizing.py` picks the (budget, depth) with the
least predicted time per token on this hardware, or lists the DP's trees for a call to choose among every step;
`plan_file.py` is the plan saved as JSON, `store.py` where plans are kept, and `lookup.py` finds a call's plan (given,
stored, re-sized or calibrated online). The tree is drafted by the shared `ModelTreeDrafter` (`draft/`) and, when
sampling, verified by the `sequoia` verifier (`verify/sampling.py`). Other methods sized with measured curves
(`tree`, `specexec`, `staged`) borrow a plan's curves through the same lookup, which the integration runs."""

from . import store
from .acceptance import AcceptanceEstimate, estimate_acceptance, rank_acceptance
from .calibrate import calibrate, measure_profile, sampling_processors
from .config import SequoiaConfig
from .dp import TreePlan, expected_tokens, expected_tokens_table, plan_tree
from .lookup import call_temperature, plan_for_call
from .plan_file import SequoiaPlan, model_fingerprint
from .sizing import choose_plan, sequoia_menu
from .store import find_plan, save_user_plan, user_plan_dir

__all__ = [
    "AcceptanceEstimate",
    "SequoiaConfig",
    "SequoiaPlan",
    "TreePlan",
    "calibrate",
    "call_temperature",
    "choose_plan",
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
    "sequoia_menu",
    "store",
    "user_plan_dir",
]
