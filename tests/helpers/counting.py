"""Counting the target's forward passes, and a greedy plan made for a pair before a test runs."""

from __future__ import annotations

import torch


class ForwardCounter:
    """Counts a model's forward calls (a forward hook: independent of hf_specdec's own stats)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def with_greedy_plan(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Make (or find) the pair's greedy plan before a test counts passes: a pair's first sized call calibrates one
    online with target passes of its own, so a count would depend on whether another test made the plan first."""
    target.generate(torch.tensor([[3, 4, 5]]), assistant_model=draft, speculation="tree", max_new_tokens=2,
                    do_sample=False)
