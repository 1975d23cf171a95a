"""One rank's raw timeline: the engine's phase edges, the optimizer's, each collective and each wait,
stamped without synchronizing anything.

On CPU a stamp is ``time.perf_counter()``. On CUDA it is an event recorded on the current stream, so
a phase edge is placed where the GPU reaches it, not where the host queued it; events are turned into
seconds only in ``timelines()``, after the steps being measured (it synchronizes the device).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from shardwire.comm.collectives import CommRecord

Span = tuple[float, float]


@dataclasses.dataclass
class StepTimeline:
    """One step on one rank, in seconds since the profile's origin (taken after a barrier, so ranks
    share it to within the barrier's skew)."""

    step: int
    start: float
    end: float
    phases: list[tuple[str, str | None, float, float]]  # (phase, unit or None, start, end)
    comms: list[tuple[str, str, int, float, float]]  # (op, tag, nbytes, start, end)
    waits: list[tuple[str, float, float]]  # (tag waited for, start, end)


@dataclasses.dataclass
class _RawStep:
    step: int
    start: object
    end: object = None
    edges: list = dataclasses.field(default_factory=list)
    comms: list[CommRecord] = dataclasses.field(default_factory=list)


class StepRecorder:
    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._origin = self.stamp()
        self._steps: list[_RawStep] = []
        self._current: _RawStep | None = None

    def stamp(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin_step(self, step: int) -> None:
        self._current = _RawStep(step, self.stamp())

    def end_step(self, comms: list[CommRecord]) -> None:
        self._current.end = self.stamp()
        self._current.comms = comms
        self._steps.append(self._current)
        self._current = None

    def on_phase(self, phase: str, unit: str | None, edge: str) -> None:
        """Engine and optimizer listener: stamp a phase edge of the step in progress."""
        if self._current is not None:
            self._current.edges.append((phase, unit, edge, self.stamp()))

    def timelines(self) -> list[StepTimeline]:
        if self._cuda:
            torch.cuda.synchronize()
        return [self._resolve(raw) for raw in self._steps]

    def _seconds(self, stamp) -> float:
        if self._cuda:
            return self._origin.elapsed_time(stamp) / 1e3
        return stamp - self._origin

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
            if record.end_event is not None:
                start, end = self._seconds(record.start_event), self._seconds(record.end_event)
            else:
                # Still in flight when the step ended (a step that did not wait for everything
                # it issued): count it as running until the step's end.
                done = record.done if record.done is not None else raw.end
                start, end = record.issued - self._origin, done - self._origin
            comms.append((record.op, record.tag, record.nbytes, start, end))
            waits += [(record.tag, self._seconds(a), self._seconds(b)) for a, b in record.waits]
        return StepTimeline(raw.step, self._seconds(raw.start), self._seconds(raw.end), phases, comms, waits)
