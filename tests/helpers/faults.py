"""Faults raised from inside a call (a processor, a stopping criterion, a streamer, a layer) to check what a call
leaves behind."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer


class Boom(Exception):
    pass


class RaisingProcessor(LogitsProcessor):
    def __init__(self, after: int, error: type[BaseException] = Boom):
        self.calls, self.after, self.error = 0, after, error

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls > self.after:
            raise self.error("processor")
        return scores


class RaisingCriterion(StoppingCriteria):
    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise Boom("criterion")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class RaisingStreamer(BaseStreamer):
    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def put(self, value):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt("streamer")

    def end(self):
        pass


def _interrupt_in_layer(target, after: int):
    """A KeyboardInterrupt inside the target's second layer on its `after + 1`-th pass: the first layer's cache has
    the tree's rows by then, the second's not."""
    calls = []

    def hook(*args):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt("target pass")

    return target.model.layers[1].register_forward_pre_hook(hook)


def _processor(after: int, error: type[BaseException] = Boom) -> dict:
    """The processor applies to the draft's and the target's scores alike: it fails on its `after + 1`-th call."""
    return {"logits_processor": LogitsProcessorList([RaisingProcessor(after, error)])}


FAULTS = {
    "processor while drafting (nothing in the cache yet)": lambda: _processor(3),
    "processor, later step": lambda: _processor(40),
    "processor interrupt": lambda: _processor(25, KeyboardInterrupt),
    "criterion inside an accepted block": lambda: {"stopping_criteria": StoppingCriteriaList([RaisingCriterion(5)])},
    "streamer after a step is compacted": lambda: {"streamer": RaisingStreamer(3)},
    "interrupt in prefill": lambda: {"layer_interrupt": 0},
    "interrupt in a tree pass": lambda: {"layer_interrupt": 3},
}
