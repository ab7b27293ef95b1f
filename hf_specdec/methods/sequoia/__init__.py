"""`speculation="sequoia"`: its config. The tree is planned by `planning/sequoia.py` (the DP) and
`planning/sizing.py` (hardware-aware size), the plan measured and stored by `calibration/`, drafted by the shared
`ModelTreeDrafter` and verified, when sampling, by the `sequoia` verifier (`verification/sampling.py`)."""

from .config import SequoiaConfig

__all__ = ["SequoiaConfig"]
