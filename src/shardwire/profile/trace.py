"""Chrome / Perfetto trace of profiled steps: one process per rank, with a compute track and one
track per communication lane.

The file is the Trace Event Format's JSON object form (``{"traceEvents": [...]}``), its
``otherData`` naming shardwire as its writer (what a rerun replaces: ``files.OUTPUTS``), with
complete events (``"ph": "X"``, microseconds) and metadata events naming processes and threads; it
opens in chrome://tracing and ui.perfetto.dev. On the compute track, units nest inside the forward
and backward phases and each wait for a collective shows where compute stalled.
"""

from __future__ import annotations

from shardwire.files import TRACE_WRITER
from shardwire.profile.analysis import StepTimeline

_TRACKS = {"compute": 0, "all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}
_TRACK_NAMES = {0: "compute", 1: "all-gather lane", 2: "reduce-scatter lane", 3: "other collectives"}


def _slice(name, category, pid, tid, start, end, args=None) -> dict:
    event = {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid,
             "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6}
    if args:
        event["args"] = args
    return event


def chrome_trace(per_rank: list[list[StepTimeline]]) -> dict:
    events = []
    for rank, timelines in enumerate(per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for tid, name in _TRACK_NAMES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for t in timelines:
            events.append(_slice(f"step {t.step}", "step", rank, 0, t.start, t.end))
            for phase, unit, start, end in t.phases:
                events.append(_slice(unit or phase, phase, rank, 0, start, end))
            for tag, start, end in t.waits:
                events.append(_slice(f"wait: {tag}", "wait", rank, 0, start, end))
            for op, tag, nbytes, wire_nbytes, start, end in t.comms:
                events.append(_slice(tag, op, rank, _TRACKS.get(op, 3), start, end,
                                     {"op": op, "bytes": nbytes, "wire_bytes": wire_nbytes, "step": t.step}))
    return {**TRACE_WRITER, "traceEvents": events, "displayTimeUnit": "ms"}
