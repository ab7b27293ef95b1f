"""The verifier registry, kept apart from `__init__` so verifier modules can register without circular imports."""

from __future__ import annotations

VERIFIERS: dict[str, type] = {}


def register_verifier(cls: type) -> type:
    """Class decorator: make a verifier selectable by its `name`."""
    VERIFIERS[cls.name] = cls
    return cls


def default_verifier_name(do_sample: bool, drafter_samples: bool = True) -> str:
    """The verifier to use when the caller names none.

    Greedy decoding: "greedy". Sampling with a drafter that samples its children from a draft model
    (model-drafted trees): "sequoia", the strongest exact rule for children drawn without replacement.
    Sampling with a deterministic drafter (top-k trees, best-first/SpecExec, n-gram): "target_sample".
    """
    if not do_sample:
        return "greedy"
    return "sequoia" if drafter_samples else "target_sample"
