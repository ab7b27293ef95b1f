"""Verifiers: turn target scores on a drafted tree into accepted tokens, registered by name (importing a verifier's
module registers it)."""

from ..core.verdict import Verdict, Verifier
from .greedy import GreedyVerifier
from .registry import VERIFIERS, register_verifier, verifier_for
from .sampling import RandomSource, SequoiaVerifier, SpecInferVerifier, TargetSampleVerifier, TorchRandom

__all__ = [
    "VERIFIERS",
    "GreedyVerifier",
    "RandomSource",
    "SequoiaVerifier",
    "SpecInferVerifier",
    "TargetSampleVerifier",
    "TorchRandom",
    "Verdict",
    "Verifier",
    "register_verifier",
    "verifier_for",
]
