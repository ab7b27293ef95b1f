"""`speculation="sequoia"`: its config. The tree is planned by `plan/sequoia.py` (the DP) and `plan/sizing.py`
(hardware-aware size), the plan measured and stored by `plan/calibrate.py` and `plan/store.py`, drafted by the shared
`ModelTreeDrafter` and verified, when sampling, by the `sequoia` verifier (`verify/sampling.py`)."""

from .config import SequoiaConfig

__all__ = ["SequoiaConfig"]
