"""The verifier registry, and the one rule that picks a call's verifier and checks it fits the method's drafter."""

from __future__ import annotations

from ..core.config import SpeculationConfig
from ..core.verdict import Verifier

VERIFIERS: dict[str, type] = {}


def register_verifier(cls: type) -> type:
    """Class decorator: make a verifier selectable by its `name`. It builds on `Verifier`, whose defaults the loops
    read (`walks`, `verify_rows`)."""
    if not issubclass(cls, Verifier):
        raise TypeError(f"{cls.__name__} is not a Verifier: subclass hf_specdec.Verifier (the loops read its `walks` "
                        "and `verify_rows`, which it declares with defaults), then register it.")
    VERIFIERS[cls.name] = cls
    return cls


def verifier_for(config: SpeculationConfig, do_sample: bool):
    """The verifier of a call: the one `config.verifier` names, else greedy when not sampling, else the method's
    best exact one. Raises when it cannot sample, samples in a greedy call (it would sample at temperature 1 where
    greedy output was asked for), or needs children drawn in a way the method's drafter cannot."""
    name = config.verifier or ("greedy" if not do_sample else config.default_sampling_verifier)
    if name not in VERIFIERS:
        raise ValueError(f"Unknown verifier {name!r}. Known verifiers: {', '.join(sorted(VERIFIERS))}.")
    if name == "greedy" and do_sample:
        raise ValueError("verifier='greedy' cannot sample: drop `verifier` or pass do_sample=False.")
    if name != "greedy" and not do_sample:
        raise ValueError(
            f"verifier={name!r} samples, but this call decodes greedily (do_sample=False): pass do_sample=True "
            "(with the temperature you want), or drop `verifier` to verify greedily."
        )
    verifier = VERIFIERS[name]()
    if verifier.child_selection not in config.child_selections:
        usable = sorted(v for v, cls in VERIFIERS.items() if cls.child_selection in config.child_selections)
        raise ValueError(
            f"verifier={name!r} needs children drawn {verifier.child_selection.replace('_', ' ')} from the draft, but "
            f"speculation={config.method!r} drafts a deterministic tree: use one of {usable}, or drop `verifier`."
        )
    return verifier
