"""One rank's raw timeline: the engine's phase edges, the optimizer's, each collective and each wait,
stamped without synchronizing anything (see ``Clock``).

A phase edge on CUDA is an event on the current stream, placed where the GPU reaches it, not where
the host queued it. A step's stamps are turned into seconds as soon as all of them are complete,
checked without blocking at the end of each later step, so a long run holds seconds, not events;
``timelines()`` resolves whatever is left (it synchronizes the device).
"""

from __future__ import annotations

import dataclasses

import torch

from shardwire.comm.clock import Clock
from shardwire.comm.records import CommRecord
from shardwire.profile.analysis import StepTimeline

Span = tuple[float, float]


@dataclasses.dataclass
class _RawStep:
    step: int
    start: object
    end: object = None
    edges: list = dataclasses.field(default_factory=list)
    comms: list[CommRecord] = dataclasses.field(default_factory=list)


class StepRecorder:
    def __init__(self, device: torch.device):
        self._clock = Clock(device)
        self._resolved: list[StepTimeline] = []
        self._unresolved: list[_RawStep] = []  # oldest first
        self._current: _RawStep | None = None

    def begin_step(self, step: int) -> None:
        self._current = _RawStep(step, self._clock.stamp())

    def end_step(self, comms: list[CommRecord]) -> None:
        self._current.end = self._clock.stamp()
        self._current.comms = comms
        self._unresolved.append(self._current)
        self._current = None
        while self._unresolved and self._complete(self._unresolved[0]):
            self._resolved.append(self._resolve(self._unresolved.pop(0)))

    def _complete(self, raw: _RawStep) -> bool:
        """Every stamp of ``raw`` can be read without waiting: its end, and the ends of its collectives
        and of every wait for them (a wait can come after the step, in the next one's clean-up)."""
        ends = [raw.end, *(r.end for r in raw.comms if r.end is not None),
                *(stall_end for r in raw.comms for _, stall_end in r.stalls)]
        return all(self._clock.ready(stamp) for stamp in ends)

    def on_phase(self, phase: str, unit: str | None, edge: str) -> None:
        """Engine and optimizer listener: stamp a phase edge of the step in progress."""
        if self._current is not None:
            self._current.edges.append((phase, unit, edge, self._clock.stamp()))

    def timelines(self) -> list[StepTimeline]:
        if self._clock.cuda:
            torch.cuda.synchronize(self._clock.device)
        self._resolved += [self._resolve(raw) for raw in self._unresolved]
        self._unresolved = []
        return list(self._resolved)

    def _seconds(self, stamp) -> float:
        return self._clock.seconds(stamp)

    def _resolve(self, raw: _RawStep) -> StepTimeline:
        phases, open_edges = [], {}
        for phase, unit, edge, stamp in raw.edges:
            if edge == "start":
                open_edges.setdefault((phase, unit), []).append(stamp)
            elif open_edges.get((phase, unit)):
                start = open_edges[(phase, unit)].pop()
                phases.append((phase, unit, self._seconds(start), self._seconds(stamp)))
        comms, waits = [], []
        for record in raw.comms:
            if record.start is None:
                continue  # queued on a lane that had not begun it when the step ended
            # Still in flight when the step ended (a step that did not wait for everything it
            # issued): count it as running until the step's end.
            end = record.end if record.end is not None else raw.end
            comms.append((record.op, record.tag, record.nbytes, record.wire_nbytes, self._seconds(record.start),
                          self._seconds(end)))
            waits += [(record.tag, self._seconds(a), self._seconds(b)) for a, b in record.stalls]
        return StepTimeline(raw.step, self._seconds(raw.start), self._seconds(raw.end), phases, comms, waits)
