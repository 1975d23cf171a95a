"""Training's scalars beyond the progress line, one record per log interval: TensorBoard event
files (``--tensorboard DIR``, the ``tensorboard`` extra) and JSON lines (``--log-jsonl FILE``,
appended to, so a resumed run goes on where it stopped). Rank 0 writes them.

A log that cannot be written (a full disk, a file system gone read-only) is one line on stderr and
the end of that log, not of the run: the model being trained, and its checkpoints, matter more."""

from __future__ import annotations

import contextlib
import json
import os
import sys

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
        self._writer = None
        if tensorboard is not None:
            require("tensorboard", "--tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(tensorboard)
        self._jsonl_path = jsonl
        if jsonl is not None:  # its directories made, as for every output (shardwire.files)
            os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
        self._jsonl = open(jsonl, "a") if jsonl is not None else None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """The scalars (keys of ``TAGS``) at ``step``."""
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(TAGS[name], value, step)
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
                self._jsonl.flush()
            except OSError as err:
                print(f"warning: --log-jsonl {self._jsonl_path}: {err.strerror or err}; training goes on without "
                      f"this log from step {step}", file=sys.stderr, flush=True)
                self._close_jsonl()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._close_jsonl()

    def _close_jsonl(self) -> None:
        """Close the JSON lines, whatever is left unwritten (its error was reported where it arose)."""
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            with contextlib.suppress(OSError):
                jsonl.close()
