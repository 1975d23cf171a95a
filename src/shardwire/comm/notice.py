"""Saying that a wait lasts: a wait bounded by a long timeout (a quorum's two hours, a collective's ten
minutes) looks like a hang from outside until it ends, so it is said while it lasts."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
import weakref
from collections.abc import Callable, Iterator


class WaitNotice:
    """Calls ``say(seconds waited, what)`` once a wait (``waiting(what)``) has lasted ``every``, and
    again at each ``every`` after unless ``repeat`` is false, from a thread that only reads when the
    wait began and what it waits for, held together so that a wait is never said under the name of
    the next. ``say`` is a bound method held weakly: the thread ends once its object is gone."""

    def __init__(self, every: datetime.timedelta, say: Callable[[float, str], None], *, repeat: bool = True):
        self._every = every.total_seconds()
        self._say = weakref.WeakMethod(say)
        self._repeat = repeat
        self._wait: tuple[float, str] | None = None  # (when it began, what it waits for)
        threading.Thread(target=self._watch, daemon=True, name="shardwire-wait-notice").start()

    @contextlib.contextmanager
    def waiting(self, what: str = "") -> Iterator[None]:
        self._wait = (time.monotonic(), what)
        try:
            yield
        finally:
            self._wait = None

    def _watch(self) -> None:
        said = None  # the wait last told of, and how long it had lasted
        while True:
            time.sleep(self._every / 4)
            say, wait = self._say(), self._wait
            if say is None:
                return
            if wait is not None:
                waited = time.monotonic() - wait[0]
                told = said[1] if said is not None and said[0] is wait else 0.0
                if waited - told >= self._every and (self._repeat or not told) and self._wait is wait:
                    say(waited, wait[1])
                    said = (wait, waited)
            del say  # held no longer than this wake: its object may go
