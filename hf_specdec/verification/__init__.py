"""Verifiers: turn target scores on a drafted tree into accepted tokens, registered by name."""

from .base import Verdict, Verifier
from .greedy import GreedyVerifier
from .processing import process_tree_scores
from .registry import VERIFIERS, default_verifier_name, register_verifier

register_verifier(GreedyVerifier)

from .sampling import (  # noqa: E402  (registers the sampling verifiers; after the registry is filled)
    RandomSource,
    SequoiaVerifier,
    SpecInferVerifier,
    TargetSampleVerifier,
    TorchRandom,
)

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
    "default_verifier_name",
    "process_tree_scores",
    "register_verifier",
]
