"""A small discrete-event core: processes written as generators, and links that share bandwidth.

A process is a generator that yields ``Event``s and resumes when the yielded event has happened;
the step simulator writes the compute lane and each communication lane as one process, which reads
like the engine's own code. A ``Link`` is a shared resource of fixed capacity: transfers through it
progress together, each at an equal share (processor sharing), so an all-gather and a
reduce-scatter crossing the same NIC at the same time each get half of it and both finish later.
A ``Processor`` does work at a rate that others lower while they run: the compute lane, which a
collective in flight slows by the share of the GPU (or the cores) it takes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator, Iterable


class Event:
    """Something that happens once, at a simulated time; callbacks run when it does."""

    __slots__ = ("sim", "time", "_callbacks")

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.time: float | None = None
        self._callbacks: list[Callable[[], None]] = []

    @property
    def happened(self) -> bool:
        return self.time is not None

    def succeed(self) -> None:
        if self.time is not None:
            raise RuntimeError("an event can happen only once")
        self.time = self.sim.now
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on(self, callback: Callable[[], None]) -> None:
        if self.time is None:
            self._callbacks.append(callback)
        else:
            callback()


Process = Generator[Event, None, None]


class Simulation:
    def __init__(self):
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def event(self) -> Event:
        return Event(self)

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (time, next(self._order), action))

    def timeout(self, seconds: float) -> Event:
        event = Event(self)
        self.at(self.now + seconds, event.succeed)
        return event

    def all_of(self, events: Iterable[Event]) -> Event:
        done, pending = Event(self), [e for e in events if not e.happened]
        remaining = [len(pending)]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.succeed()

        if not pending:
            self.at(self.now, done.succeed)
        for event in pending:
            event.on(one_done)
        return done

    def start(self, process: Process) -> Event:
        """Run ``process`` from now on; the returned event happens when it returns."""
        finished = Event(self)

        def resume() -> None:
            try:
                waiting_for = next(process)
            except StopIteration:
                finished.succeed()
                return
            if waiting_for.happened:  # resume from the queue: no recursion through many such waits
                self.at(self.now, resume)
            else:
                waiting_for.on(resume)

        self.at(self.now, resume)
        return finished

    def run(self) -> None:
        while self._queue:
            self.now, _, action = heapq.heappop(self._queue)
            action()


class Link:
    """A resource moving ``capacity`` bytes per second, shared equally by the transfers on it.

    ``slow(share)`` lowers the rate to ``1 - share`` of the capacity until ``slow(0)``: what running
    compute takes from the collectives on it."""

    def __init__(self, sim: Simulation, capacity: float):
        self.sim = sim
        self.capacity = capacity
        self._rate = capacity
        self._transfers: dict[Event, float] = {}  # completion event -> bytes left
        self._since = 0.0
        self._generation = 0
        self.busy_s = 0.0  # time during which at least one transfer was moving
        self.moved = 0.0  # bytes of the transfers started

    def transfer(self, nbytes: float) -> Event:
        done = Event(self.sim)
        if nbytes <= 0:
            self.sim.at(self.sim.now, done.succeed)
            return done
        self.moved += nbytes
        self._settle()
        self._transfers[done] = nbytes
        self._plan()
        return done

    def slow(self, share: float) -> None:
        """Move bytes at ``1 - share`` of the capacity from now on."""
        rate = self.capacity * (1.0 - share)
        if rate != self._rate:
            self._settle()
            self._rate = rate
            self._plan()

    def _settle(self) -> None:
        """Account for the bytes moved since the last change."""
        elapsed = self.sim.now - self._since
        if self._transfers and elapsed > 0:
            share = self._rate * elapsed / len(self._transfers)
            for event in self._transfers:
                self._transfers[event] -= share
            self.busy_s += elapsed
        self._since = self.sim.now

    def _plan(self) -> None:
        """Schedule the next completion; completions planned before a change are ignored."""
        self._generation += 1
        if not self._transfers:
            return
        generation = self._generation
        soonest = min(self._transfers.values())
        finish = self.sim.now + max(0.0, soonest) * len(self._transfers) / self._rate
        self.sim.at(finish, lambda: self._complete(generation))

    def _complete(self, generation: int) -> None:
        """Finish the transfer this completion was planned for, whatever rounding left on it.

        Settling subtracts floats, so the planned transfer may keep a remainder: from bytes too
        many to subtract exactly, or from a clock so far along that its duration no longer moves
        it (1e-3 s added to 1e14 s changes nothing). Judged by its remainder it would be planned
        again, at once, without end. The planned transfer is the one with the least left (none
        was added or removed since, or the generation would differ), so it is done, with every
        transfer left with no more than it, or than a byte or a nanosecond's worth (transfers
        finishing together): each completion finishes at least one transfer, and a link schedules
        at most two actions per transfer (at its start and at its end) whatever its sizes,
        capacity and clock.
        """
        if generation != self._generation:
            return
        self._settle()
        done_below = max(min(self._transfers.values()), 1.0, self.capacity * 1e-9)
        finished = [e for e, left in self._transfers.items() if left <= done_below]
        for event in finished:
            del self._transfers[event]
        self._plan()
        for event in finished:
            event.succeed()


class Processor:
    """One job at a time, done at a rate that others lower while they hold a share of it.

    A job of ``seconds`` takes that long on the processor to itself. Each holder takes a share ``s``
    of what is left to the job (two collectives in flight, each holding its own SMs or threads,
    leave ``(1 - s1)(1 - s2)``), so the job stretches over the time it overlaps them, and only that
    time. ``slowed_s`` adds up how much longer the jobs took than their ``seconds``.
    """

    def __init__(self, sim: Simulation):
        self.sim = sim
        self._shares: list[float] = []
        self._job: Event | None = None
        self._left = 0.0  # seconds of work, at the full rate, the job has left
        self._since = 0.0
        self._generation = 0
        self.slowed_s = 0.0

    @property
    def rate(self) -> float:
        rate = 1.0
        for share in self._shares:
            rate *= 1.0 - share
        return rate

    def run(self, seconds: float) -> Event:
        """Do ``seconds`` of work; the event happens when it is done."""
        if self._job is not None:
            raise RuntimeError("a processor runs one job at a time")
        done = Event(self.sim)
        self._job, self._left, self._since = done, seconds, self.sim.now
        self._plan()
        return done

    def hold(self, share: float) -> None:
        """Take ``share`` of the processor until ``release(share)``."""
        if share > 0:
            self._settle()
            self._shares.append(share)
            self._plan()

    def release(self, share: float) -> None:
        if share > 0:
            self._settle()
            self._shares.remove(share)
            self._plan()

    def _settle(self) -> None:
        """Account for the work done since the last change of rate."""
        elapsed = self.sim.now - self._since
        if self._job is not None and elapsed > 0:
            rate = self.rate
            self._left -= elapsed * rate
            self.slowed_s += elapsed * (1.0 - rate)
        self._since = self.sim.now

    def _plan(self) -> None:
        """Schedule the job's end at the present rate; ends planned before a change are ignored."""
        self._generation += 1
        if self._job is None:
            return
        generation = self._generation
        self.sim.at(self.sim.now + max(0.0, self._left) / self.rate, lambda: self._finish(generation))

    def _finish(self, generation: int) -> None:
        """End the job this was planned for, whatever rounding left of it (as ``Link._complete``)."""
        if generation != self._generation:
            return
        self._settle()
        done, self._job = self._job, None
        self._generation += 1
        done.succeed()
