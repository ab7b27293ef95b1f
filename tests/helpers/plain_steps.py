"""Captured calls whose schedule takes plain steps (the root alone) where a test says, its shape elsewhere."""

from __future__ import annotations

from collections.abc import Callable

from hf_specdec.decoding import captured


def plain_steps_where(monkeypatch, plain: Callable[[int], bool]) -> None:
    """Every captured schedule picks the root alone at the steps `i` (0: a call's first) where `plain(i)`, its fixed
    shape elsewhere: plain steps among trees in a pattern the test knows, as the guard or a sized schedule makes
    them."""

    def next_shape(self):
        self.steps = getattr(self, "steps", -1) + 1
        return (-1,) if plain(self.steps) else self.fixed

    monkeypatch.setattr(captured.ShapeSchedule, "next", next_shape)
