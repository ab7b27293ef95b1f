"""The contracts every layer above shares: the TokenTree value and its operations (`tree.py`), the Drafter and
Verifier interfaces (`drafter.py`, `verdict.py`) and the token inputs a drafter takes (`model_inputs.py`), the config
registry (`config.py`), and what differs between the Transformers releases supported (`releases.py`).

Nothing here runs a drafting or verification algorithm; everything above builds on these.
"""

from .config import SPECULATION_METHODS, PlanRequest, SpeculationConfig, make_config, register_speculation
from .drafter import Drafter, first_child_chain
from .tree import TokenTree
from .verdict import Verdict, Verifier

__all__ = [
    "SPECULATION_METHODS",
    "Drafter",
    "PlanRequest",
    "SpeculationConfig",
    "TokenTree",
    "Verdict",
    "Verifier",
    "first_child_chain",
    "make_config",
    "register_speculation",
]
