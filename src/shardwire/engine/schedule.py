"""The prefetch schedule: the order units ran in, and a sliding window of gathers issued ahead of it.

The first forward and the first backward record the order in which units run; every later pass
issues the gathers of the next units in that order before they are needed, so the network works
while the current unit computes. At most ``window`` units are gathered ahead of the one running, and
the window slides one unit at a time: the moment a unit starts, the gather of the unit ``window``
places after it is issued. (A block-and-flush limiter, which waits for a whole group of gathers to
be consumed before issuing the next group, leaves the network idle at every group boundary.)

When a pass departs from the recorded order, prefetching stops for the rest of that pass, units are
gathered on demand, and the pass records the new order for the next one.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwire.engine.unit import Unit


class Pass:
    """One forward or one backward walk over the units."""

    def __init__(self, expected: list[Unit] | None, window: int, prefetch: Callable[[Unit], None]):
        self.seen: list[Unit] = []
        self.recording = expected is None
        self._expected = expected or []
        self._window = window
        self._prefetch = prefetch
        self._issued = 0
        self._top_up()

    def enter(self, unit: Unit) -> None:
        """``unit`` starts running in this pass."""
        position = len(self.seen)
        self.seen.append(unit)
        if not self.recording:
            if position < len(self._expected) and self._expected[position] is unit:
                self._top_up()
            else:
                self.recording = True

    def changed_order(self) -> bool:
        """True when this pass's order must replace the recorded one."""
        return self.recording or len(self.seen) != len(self._expected)

    def _top_up(self) -> None:
        while self._issued < len(self._expected) and self._issued - len(self.seen) < self._window:
            self._prefetch(self._expected[self._issued])
            self._issued += 1
