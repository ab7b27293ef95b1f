"""Plain steps (the root alone) where a test says: in captured calls (their schedule) and in the loop (its guard)."""

from __future__ import annotations

from collections.abc import Callable

from hf_specdec.decoding import captured
from hf_specdec.draft import guarded
from hf_specdec.plan.guard import PlainGuard


def plain_steps_where(monkeypatch, plain: Callable[[int], bool]) -> None:
    """Every captured schedule picks the root alone at the steps `i` (0: a call's first) where `plain(i)`, its fixed
    shape elsewhere: plain steps among trees in a pattern the test knows, as the guard or a sized schedule makes
    them."""

    def next_shape(self):
        self.steps = getattr(self, "steps", -1) + 1
        return (-1,) if plain(self.steps) else self.fixed

    monkeypatch.setattr(captured.ShapeSchedule, "next", next_shape)


def guard_plain_at(monkeypatch, steps: tuple[int, ...]) -> None:
    """A single sequence's measured guard makes the loop's steps `steps` (0: a call's first) plain and no other, as a
    wait it carried over or a loss it judged would: plain steps where a test knows them, through the loop's own
    path (`draft.guarded.GuardedDrafter`)."""

    class PlainAt(PlainGuard):
        def plain_next(self, rows: int = 1) -> bool:
            self.asked = getattr(self, "asked", -1) + 1  # asked once a step
            return self.asked in steps

    monkeypatch.setattr(guarded, "sequence_guard", PlainAt)
