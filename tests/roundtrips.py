"""Count host round trips during speculative steps on CPU: every read of a tensor's values into Python.

On a GPU each such read of a device tensor (`item`, `bool`, `int`, `float`, `tolist`, `numpy`, `.cpu()`, a tensor
used as a Python index) blocks until the stream catches up. On CPU every tensor is a host tensor, so this counts
every read, which bounds the syncs a GPU run would make with all step tensors on the device. Reads inside model
forward passes (Transformers' own code, the same as in plain generate) are not counted, nor is anything before the
first `propose` of the loop (the prompt's prefill and the setup) or after the loop returns.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import hf_specdec.decoding.captured as captured
import hf_specdec.integration.batch as batch_integration
import hf_specdec.integration.generate as integration

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@dataclass
class Step:
    """One speculative step: its host reads and the draft passes it made."""

    reads: int = 0
    draft_passes: int = 0
    emitted: int = 0  # tokens the step appended


@dataclass
class RoundTrips:
    """What the counted `generate` calls did."""

    steps: list[Step] = field(default_factory=list)
    reads: int = 0
    target_passes: int = 0  # = steps (the prefill pass is not one) but the passless ones
    passless: int = 0  # steps that ran no target pass: a call's plain first step (the prompt's pass gave its token)
    draft_passes: int = 0
    active: bool = False
    in_model: int = 0

    @property
    def per_step(self) -> float:
        return self.reads / max(self.target_passes + self.passless, 1)

    @property
    def allowed(self) -> int:
        """The issue's bound: at most the draft passes + 2 reads per step."""
        return self.draft_passes + 2 * (self.target_passes + self.passless)


def batch_draft_passes(drafter) -> int:
    """Draft passes a batch drafter made: the lockstep drafter's (shared by every row), or every row drafter's."""
    if hasattr(drafter, "forward_count"):
        return drafter.forward_count
    return sum(row.forward_count for row in drafter.drafters)


@contextmanager
def count_round_trips(*models: torch.nn.Module):
    """Count reads during the speculative loop's steps of every `generate` inside (the single-sequence loop's, a
    batch's, whose step is every row's, and captured steps'); yields a `RoundTrips`."""
    counts = RoundTrips()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if counts.active and not counts.in_model:
                counts.reads += 1
            return original(self, *args, **kwargs)

        return read

    def enter(*_):
        counts.in_model += 1

    def leave(*_):
        counts.in_model -= 1

    hooks = [h for m in models for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    loop = integration.speculative_loop

    def counted_loop(target, input_ids, drafter, *args, **kwargs):
        propose = drafter.propose
        last = [0, 0]  # reads and draft passes when the current step began

        def close_step():
            if counts.active:
                counts.steps.append(Step(counts.reads - last[0], drafter.forward_count - last[1]))

        def first_propose_starts(ids):
            close_step()
            counts.active = True
            last[:] = counts.reads, drafter.forward_count
            return propose(ids)

        drafter.propose = first_propose_starts
        try:
            result = loop(target, input_ids, drafter, *args, **kwargs)
            close_step()
        finally:
            counts.active = False
            del drafter.propose
        for step, emitted in zip(counts.steps[len(counts.steps) - len(result.stats.tokens_per_step) :],
                                 result.stats.tokens_per_step):
            step.emitted = emitted
        counts.target_passes += result.stats.target_forwards
        counts.passless += len(result.stats.tokens_per_step) - result.stats.target_forwards
        counts.draft_passes += result.stats.draft_forwards
        return result

    batch_loop = batch_integration.batch_speculative_loop

    def counted_batch_loop(target, input_ids, attention_mask, drafter, *args, **kwargs):
        """A batch step: from one `propose` (every row's trees) to the next; its draft passes are every row's."""
        propose = drafter.propose
        last = [0, 0]

        def close_step():
            if counts.active:
                counts.steps.append(Step(counts.reads - last[0], batch_draft_passes(drafter) - last[1]))

        def first_propose_starts(*propose_args):
            close_step()
            counts.active = True
            last[:] = counts.reads, batch_draft_passes(drafter)
            return propose(*propose_args)

        drafter.propose = first_propose_starts
        try:
            result = batch_loop(target, input_ids, attention_mask, drafter, *args, **kwargs)
            close_step()
        finally:
            counts.active = False
            del drafter.propose
        steps = max(row.target_forwards for row in result.stats)
        for index, step in enumerate(counts.steps[len(counts.steps) - steps :]):
            step.emitted = sum(row.tokens_per_step[index] for row in result.stats if index < len(row.tokens_per_step))
        counts.target_passes += steps
        counts.draft_passes += batch_draft_passes(drafter)
        return result

    captured_loop = integration.captured_loop
    steps = ("step", "plain_step", "first_plain_step", "resume")
    captured_methods = {name: getattr(captured.CapturedStep, name) for name in (*steps, "_draft_pass")}

    def counted_captured_loop(target, input_ids, drafter, *args, **kwargs):
        """A captured step: from one call of a step function (a tree's, or a plain step's) to the next, a tree's
        starting at the draft's catch-up after plain steps (`resume`) where there is one; its draft passes counted
        as they run."""
        last = [0]
        passes = []
        resumed = [False]

        def close_step():
            if counts.active:
                counts.steps.append(Step(counts.reads - last[0], passes[-1]))

        def opening(name):
            def opened(self, *args):
                if not (name == "step" and resumed[0]):  # a tree after plain steps: its window opened at `resume`
                    close_step()
                    counts.active = True
                    last[0] = counts.reads
                    passes.append(0)
                resumed[0] = name == "resume"
                return captured_methods[name](self, *args)
            return opened

        def counted_pass(self, *args):
            if counts.active:
                passes[-1] += 1
            return captured_methods["_draft_pass"](self, *args)

        for name in steps:
            setattr(captured.CapturedStep, name, opening(name))
        captured.CapturedStep._draft_pass = counted_pass
        try:
            result = captured_loop(target, input_ids, drafter, *args, **kwargs)
            close_step()
        finally:
            counts.active = False
            for name, method in captured_methods.items():
                setattr(captured.CapturedStep, name, method)
        for step, emitted in zip(counts.steps[len(counts.steps) - len(passes) :], result.stats.tokens_per_step):
            step.emitted = emitted
        counts.target_passes += result.stats.target_forwards
        counts.passless += len(result.stats.tokens_per_step) - result.stats.target_forwards
        counts.draft_passes += result.stats.draft_forwards
        return result

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    integration.speculative_loop = counted_loop
    integration.captured_loop = counted_captured_loop
    batch_integration.batch_speculative_loop = counted_batch_loop
    try:
        yield counts
    finally:
        integration.speculative_loop = loop
        integration.captured_loop = captured_loop
        batch_integration.batch_speculative_loop = batch_loop
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for hook in hooks:
            hook.remove()
