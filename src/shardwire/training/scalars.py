"""Training's scalars beyond the progress line, one record per log interval: TensorBoard event
files (``--tensorboard DIR``, the ``tensorboard`` extra) and JSON lines (``--log-jsonl FILE``,
appended to, so a resumed run goes on where it stopped). Rank 0 writes them.

A log that cannot be written (a full disk, a file system gone read-only) is one line on stderr and
the end of that log, not of the run: the model being trained, and its checkpoints, matter more. So
each log is opened at its first record, to say the step it ends at, and each record is flushed as
it is written, where its error surfaces. TensorBoard's event file is written here, framed as
torch's ``SummaryWriter`` frames it, rather than through that writer: it writes on a thread of its
own, which prints a traceback of its own when a write fails, and the error reaches the caller only
at a later call (its constructor among them)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

from shardwire.extras import require

# TensorBoard's tag for each scalar: grouped so that its dashboard shows one panel per group.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "comm_s": "comm/busy_s",
    "exposed_comm_s": "comm/exposed_s",
    "val_loss": "val/loss",
    "mfu": "perf/mfu",
    "sync_outer_grad_norm": "sync/outer_grad_norm",
    "sync_drift": "sync/drift",
    "sync_groups": "sync/groups",
    "sync_dropped": "sync/dropped",
    "sync_recovered": "sync/recovered",
    "sync_skipped_steps": "sync/skipped_steps",
    "sync_wait_s": "sync/wait_s",
    "sync_recovery_bytes": "sync/recovery_bytes",
}


class ScalarLog:
    def __init__(self, tensorboard: str | None = None, jsonl: str | None = None):
        self._logs: list[_EventFile | _JsonLines] = []
        if tensorboard is not None:
            require("tensorboard", "--tensorboard")
            self._logs.append(_EventFile(tensorboard))
        if jsonl is not None:
            self._logs.append(_JsonLines(jsonl))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """The scalars (keys of ``TAGS``) at ``step``."""
        for log in list(self._logs):
            try:
                log.write(step, scalars)
            except OSError as err:
                print(f"warning: {log.named}: {err.strerror or err}; training goes on without this log from step "
                      f"{step}", file=sys.stderr, flush=True)
                self._end(log)

    def close(self) -> None:
        for log in list(self._logs):
            self._end(log)

    def _end(self, log: _EventFile | _JsonLines) -> None:
        """Close ``log``, whatever is left unwritten (its error was reported where it arose)."""
        self._logs.remove(log)
        with contextlib.suppress(OSError):
            log.close()


class _JsonLines:
    """``--log-jsonl FILE``: a JSON object a record, appended."""

    def __init__(self, path: str):
        self.named = f"--log-jsonl {path}"
        self._path = path
        self._file = None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self._file is None:  # its directories made, as for every output (shardwire.files)
            os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
            self._file = open(self._path, "a")
        self._file.write(json.dumps({"step": step, **scalars}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _EventFile:
    """``--tensorboard DIR``: a TensorBoard event file in DIR, named as ``SummaryWriter`` names its
    own (``events.out.tfevents.<time>.<host>.<pid>``), a new one each run; an event a record."""

    def __init__(self, directory: str):
        self.named = f"--tensorboard {directory}"
        self._directory = directory
        self._records = None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        if self._records is None:  # its first event the format's version, which readers look for
            os.makedirs(self._directory, exist_ok=True)
            file = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
            # appended to: never written over, were another log of this process started in the same second
            self._records = RecordWriter(open(os.path.join(self._directory, file), "ab"))
            self._records.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        values = [Summary.Value(tag=TAGS[name], simple_value=float(value)) for name, value in scalars.items()]
        self._records.write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)).SerializeToString())
        self._records.flush()

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
