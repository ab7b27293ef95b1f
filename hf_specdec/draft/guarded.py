"""Any drafter behind the measured guard (plan/guard.py): a plain step is the root alone, proposed as a TokenTree.

The loop never knows: it verifies a one-node tree with one target pass over one token, which is plain decoding's
step (greedy output identical, sampling exact, the same code path), and the drafter underneath catches up with the
tokens it did not see on its next proposal, as it does after any accepted block.
"""

from __future__ import annotations

import time
from collections.abc import Hashable

import torch
from torch._dynamo.utils import counters

from ..core.drafter import Drafter
from ..core.model_inputs import TokenInputs
from ..core.tree import HostTree, TokenTree
from ..core.verdict import Verdict
from ..plan.guard import PlainGuard, remembered_guard

#: a single sequence's guard measures a plain step again in each call whose speculative steps do not beat the last
#: measured plain rate this many times over (plan/guard.py: the estimate alone flattered plain decoding by up to 1.8x)
SURE_WIN = 1.25


def sequence_guard() -> PlainGuard:
    """A new guard for a single sequence's calls: judged against a measured plain step."""
    return PlainGuard(measure_plain=True, sure_win=SURE_WIN)


def root_only(last: int, device: torch.device) -> TokenTree:
    """The tree of a plain step: the last committed token alone."""
    return TokenTree(tokens=torch.tensor([last], device=device), parents=torch.tensor([-1], device=device),
                     _host=HostTree(parents=[-1], tokens=[last]))


class GuardedDrafter(Drafter):
    """`inner`'s trees while they beat plain decoding's measured rate; plain steps while they do not."""

    def __init__(self, inner: Drafter, guard: PlainGuard | None = None) -> None:
        self.inner = inner
        self.guard = guard or sequence_guard()
        self._started: float | None = None  # when the last proposal began (a step runs until the next one)
        self._last: tuple[bool, int] | None = None  # (plain, tokens emitted) of the last step
        self._draft_time = 0.0  # the inner drafter's pass time when the last step began
        self._graphs = 0  # graphs dynamo had compiled when the last step began
        self._first = True  # the call's first step is under way (the draft's pass over the prompt: never judged)
        self._window: int | None = None  # the most prompt tokens the draft reads (`use_window`)
        self._prompt = 0  # the prompt tokens the draft read in the call's first step

    @staticmethod
    def guard_for(target: object, draft: object | None, key: Hashable) -> PlainGuard:
        """The guard the last call with these models and `key` left, or a new one: what prices a call before its
        drafter is made (`PlainGuard.price`)."""
        return remembered_guard(target, draft, key, sequence_guard)

    @property
    def num_drafting_tokens(self) -> int:
        return self.inner.num_drafting_tokens

    @property
    def forward_count(self) -> int:
        return self.inner.forward_count

    @property
    def forward_time(self) -> float:
        return self.inner.forward_time

    @property
    def shrunk_steps(self) -> int:
        return self.inner.shrunk_steps

    @property
    def size_probes(self) -> int:
        return self.inner.size_probes

    @property
    def deepened_levels(self) -> int:
        return self.inner.deepened_levels

    @property
    def draft_pass_sizes(self) -> set[int]:
        return self.inner.draft_pass_sizes

    @property
    def draft_sizes_kept_eager(self) -> set[int]:
        return self.inner.draft_sizes_kept_eager

    def share_rows(self, rows: int) -> None:
        self.inner.share_rows(rows)

    @property
    def guard_plain_steps(self) -> int:
        return self.guard.plain_steps

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        now, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
        if self._started is not None and self._last is not None and graphs == self._graphs and not self._first:
            # a step that compiled a graph (a compiled forward meeting a new tree size) is not judged on its time
            self.guard.observe(now - self._started, self._last[1], self._last[0], self.forward_time - self._draft_time)
        elif self._first and self._last is not None and not self._last[0] and graphs == self._graphs:
            # the call's first step speculated: its draft passes read the prompt (the guard prices calls with it),
            # the rest is judged as any step's
            self.guard.observe_first(now - self._started, self._last[1], self.forward_time - self._draft_time,
                                     self._prompt)
        if self._started is None:
            self._prompt = input_ids.shape[1] if self._window is None else min(input_ids.shape[1], self._window)
        self._first = self._started is None
        self._started, self._last, self._draft_time, self._graphs = now, None, self.forward_time, graphs
        if self.guard.plain_next():
            sequence = getattr(self.inner, "sequence", None)  # a host copy of the ids: no read from the device
            last = sequence.read(input_ids)[-1] if sequence is not None else int(input_ids[0, -1])
            return root_only(last, getattr(getattr(self.inner, "runner", None), "device", input_ids.device))
        return self.inner.propose(input_ids)

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        self._last = (len(tree) == 1, len(verdict.path))
        self.inner.accept(input_ids, tree, verdict)

    def use_inputs(self, inputs: TokenInputs) -> None:
        self.inner.use_inputs(inputs)

    def use_static_cache(self, rows: int, compiled) -> None:
        self.inner.use_static_cache(rows, compiled)

    def use_window(self, tokens: int | None) -> None:
        self._window = tokens
        self.inner.use_window(tokens)

    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        self.inner.observe_target_pass(tree_size, seconds)

    def node_scores(self, nodes: list[int]) -> torch.Tensor | None:
        return self.inner.node_scores(nodes)

    def __getattr__(self, name: str):
        """Everything else (stage counts, the runner, ...) is the inner drafter's."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
