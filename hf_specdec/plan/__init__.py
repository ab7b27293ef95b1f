"""Plan: what the methods share to shape and size a step's tree. Shapes (chain, per-level widths) and the acceptance
vector (`shapes.py`); measured latency curves (`latency.py`) and a pair's profile (`sizing.py`); the per-step cost
models (`step_sizing.py`: best-first growth; `shape_sizing.py`: a menu of static shapes); the confidence cut
(`confidence.py`); the measured guard that turns steps plain (`guard.py`) and a batch call's price (`call_pricing.py`).
A method's own planner lives in its folder: Sequoia's DP, calibration and plan files in `methods/sequoia/`."""

from .shapes import chain_parents, validate_acceptance, validate_parents, widths_parents

__all__ = ["chain_parents", "validate_acceptance", "validate_parents", "widths_parents"]
