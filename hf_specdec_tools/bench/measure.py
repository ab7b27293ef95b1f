"""Per-call instruments that see every strategy the same way: forward hooks count model passes (so Transformers'
own baselines get counts too), a sampling thread records the resident-memory high-water mark."""

from __future__ import annotations

import threading

import psutil
import torch


class ForwardCounter:
    """Counts top-level forward passes of a causal LM, whoever makes them.

    Hooks sit on the LM and on its base model (drafters may call `model.model` directly to skip the head); a
    depth counter makes a pass that enters both count once, and nested calls never count twice.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._depth = 0
        modules = {id(model): model}
        base = getattr(model, "base_model", None)
        if isinstance(base, torch.nn.Module):
            modules.setdefault(id(base), base)
        self._handles = []
        for module in modules.values():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, *_args) -> None:
        if self._depth == 0:
            self.calls += 1
        self._depth += 1

    def _leave(self, *_args) -> None:
        self._depth = max(self._depth - 1, 0)

    def take(self) -> int:
        """Passes since the last `take`, and start counting afresh."""
        calls, self.calls, self._depth = self.calls, 0, 0
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class PeakMemory:
    """Context manager: resident set size before the block and its high-water mark during it (bytes).

    RSS is sampled every `interval` seconds by a background thread (psutil), plus once at the end, so a spike
    shorter than the interval can be missed; the GIL hand-off costs every strategy alike.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.process = psutil.Process()
        self.before = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def delta(self) -> int:
        """Extra resident bytes at the peak, relative to just before the call."""
        return max(self.peak - self.before, 0)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        self.before = self.peak = self.process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="hf-specdec-bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
