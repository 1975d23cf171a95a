"""Training's scalars beyond the progress line, one record per log interval: TensorBoard event
files (``--tensorboard DIR``, the ``tensorboard`` extra) and JSON lines (``--log-jsonl FILE``,
appended to, so a resumed run goes on where it stopped). Rank 0 writes them.

A log that cannot be written (a full disk, a file system gone read-only) is one line on stderr and
the end of that log, not of the run: the model being trained, and its checkpoints, matter more. So
each log is opened at its first record, to say the step it ends at, and each record goes straight
to its file, where its error surfaces, whole or not at all (``_AppendedFile``). TensorBoard's event
file is written here, framed as torch's ``SummaryWriter`` frames it, rather than through that
writer: it writes on a thread of its own, which prints a traceback of its own when a write fails,
and the error reaches the caller only at a later call (its constructor among them)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import time
from collections.abc import Callable

from shardwire.extras import require
from shardwire.files import make_directories, remove_directories

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


class _AppendedFile:
    """A file that records are appended to, each whole or not at all: a write the disk stops part-way
    is cut back off, so the file never ends in half a record (onto which a resumed run would append
    its next). Made at its first record, with the directories it needs; where that first record
    fails, what was made for it is removed again: a log that never held a record leaves nothing."""

    def __init__(self, path: str):
        self._path = path
        self._fd: int | None = None
        self._made: list[str] = []  # the directories made for it
        self._new = False  # made by this run
        self._records = 0

    def append(self, record: bytes, first: Callable[[int], bytes] = lambda size: b"") -> None:
        """Append ``record``, after ``first(size of the file found)`` where the file is opened."""
        if self._fd is None:
            self._made = make_directories(os.path.dirname(os.path.abspath(self._path)))
            self._new = not os.path.lexists(self._path)
            self._fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            record = first(os.fstat(self._fd).st_size) + record
        start = os.fstat(self._fd).st_size
        try:
            left = memoryview(record)
            while left:
                left = left[os.write(self._fd, left):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise
        self._records += 1

    def last_byte(self) -> bytes:
        return os.pread(self._fd, 1, os.fstat(self._fd).st_size - 1)

    def close(self) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if self._new and not self._records:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            remove_directories(self._made)


class _JsonLines:
    """``--log-jsonl FILE``: a JSON object a line, appended."""

    def __init__(self, path: str):
        self.named = f"--log-jsonl {path}"
        self._file = _AppendedFile(path)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        line = (json.dumps({"step": step, **scalars}) + "\n").encode()
        self._file.append(line, first=self._after_the_last_line)

    def _after_the_last_line(self, size: int) -> bytes:
        """A line break first where the file found ends in a line a killed writer left unended, so that
        this run's first line is a line of its own (what was there is kept)."""
        return b"\n" if size and self._file.last_byte() != b"\n" else b""

    def close(self) -> None:
        self._file.close()


class _EventFile:
    """``--tensorboard DIR``: a TensorBoard event file in DIR, named as ``SummaryWriter`` names its
    own (``events.out.tfevents.<time>.<host>.<pid>``), a new one each run; an event a record, framed
    by tensorboard's ``RecordWriter``, its first the format's version, which readers look for."""

    def __init__(self, directory: str):
        self.named = f"--tensorboard {directory}"
        file = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self._file = _AppendedFile(os.path.join(directory, file))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=TAGS[name], simple_value=float(value)) for name, value in scalars.items()]
        event = Event(wall_time=time.time(), step=step, summary=Summary(value=values))
        self._file.append(_framed(event), first=lambda size: b"" if size else _framed(
            Event(wall_time=time.time(), file_version="brain.Event:2")))

    def close(self) -> None:
        self._file.close()


def _framed(event) -> bytes:
    """``event`` as an event file holds it: length, checksums and all (tensorboard's ``RecordWriter``)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    framed = io.BytesIO()
    RecordWriter(framed).write(event.SerializeToString())
    return framed.getvalue()
