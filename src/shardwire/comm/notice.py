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
    """Calls ``say(seconds waited)`` once a wait (``waiting``) has lasted ``every``, and again at each
    ``every`` after unless ``repeat`` is false, from a thread that only reads the time the wait
    began. ``say`` is a bound method held weakly: the thread ends once its object is gone."""

    def __init__(self, every: datetime.timedelta, say: Callable[[float], None], *, repeat: bool = True):
        self._every = every.total_seconds()
        self._say = weakref.WeakMethod(say)
        self._repeat = repeat
        self._since: float | None = None
        threading.Thread(target=self._watch, daemon=True, name="shardwire-wait-notice").start()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        said = None  # the wait last told of, and how long it had lasted
        while True:
            time.sleep(self._every / 4)
            say, since = self._say(), self._since
            if say is None:
                return
            if since is not None:
                waited = time.monotonic() - since
                told = said[1] if said is not None and said[0] == since else 0.0
                if waited - told >= self._every and (self._repeat or not told):
                    say(waited)
                    said = (since, waited)
            del say  # held no longer than this wake: its object may go
