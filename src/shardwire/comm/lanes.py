"""Lanes: threads that carry out one communicator's point-to-point collectives, one after another.

On gloo the engine's all-gathers and reduce-scatters are built from tag-matched point-to-point
messages (see ``exchange``). A lane is the CPU counterpart of a CUDA side stream: the training
thread only queues a collective on it, and the lane issues its messages, waits for them, does its
local copy or sum and reports completion, so computation goes on meanwhile. Each communicator owns
its lanes, so collectives of different process groups never queue behind each other.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from collections.abc import Callable

import torch

# How long the process waits at exit for a lane's last collective; one stuck on a peer that stopped
# is left behind after this.
EXIT_TIMEOUT_S = 5.0


class LaneWork:
    """A c10d ``Work`` lookalike for a collective that a lane carries out."""

    def __init__(self):
        self._future: torch.futures.Future = torch.futures.Future()
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        if not self._finished.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out")
        if self._error is not None:
            raise self._error

    def complete(self, error: BaseException | None) -> None:
        # The future first: a waiter woken by the event may go on to end the process, and the lane
        # must not be inside torch's C++ code by then.
        self._error = error
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)
        self._finished.set()


class Lane:
    """A thread that carries out queued collectives one after another.

    The thread starts with the first collective. A daemon thread still inside gloo when the
    interpreter shuts down aborts the process ("terminate called without an active exception"), so
    a lane is stopped when its owner is collected and, at the latest, at interpreter exit.
    """

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop: weakref.finalize | None = None  # stops the thread; runs at most once

    def submit(self, collective: Callable[[], None]) -> LaneWork:
        if self._stop is None:
            thread = threading.Thread(target=_run, args=(self._queue,), name=self._name, daemon=True)
            thread.start()
            self._stop = weakref.finalize(self, _stop, self._queue, thread)
        work = LaneWork()
        self._queue.put((collective, work))
        return work

    def stop(self) -> None:
        """Let the queued collectives finish, then end the thread."""
        if self._stop is not None:
            self._stop()
            self._stop = None


def _stop(work_queue: queue.SimpleQueue, thread: threading.Thread) -> None:
    work_queue.put(None)
    thread.join(EXIT_TIMEOUT_S)


def _run(work_queue: queue.SimpleQueue) -> None:
    while (item := work_queue.get()) is not None:
        collective, work = item
        try:
            collective()
        except BaseException as err:  # handed to whoever waits on the work
            work.complete(err)
        else:
            work.complete(None)
        # drop the references now: the buffers and the process group are not the lane's to keep
        item = collective = work = None
