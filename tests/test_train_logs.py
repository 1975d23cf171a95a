"""``shardwire train --tensorboard DIR --log-jsonl FILE``: the same scalars, each log interval, read
back with TensorBoard's own event reader; and a missing extra is refused before any worker starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwire.cli import main

pytestmark = pytest.mark.slow


def test_tensorboard_and_json_lines_hold_each_intervals_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events, lines = tmp_path / "tb", tmp_path / "log.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "20", "--log-every", "5",
         "--nproc", "1", "--eval-batches", "1", "--eval-every", "10", "--tensorboard", str(events),
         "--log-jsonl", str(lines)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    assert {"loss", "lr", "tokens_per_s", "step_time_s", "comm_s", "exposed_comm_s"} <= set(records[0])
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20]
    board = EventAccumulator(str(events))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "comm/exposed_s", "val/loss"} <= tags
    logged = [(e.step, e.value) for e in board.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert records[-1]["loss"] < records[0]["loss"]


def test_the_syncs_scalars_reach_tensorboard_and_json_lines(tmp_path):
    """Under --diloco each log interval also holds what its syncs did, under TensorBoard tags of their own."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events, lines = tmp_path / "tb", tmp_path / "log.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", "10", "--log-every", "5",
         "--nproc", "2", "--layout", "hybrid", "--shard-group-size", "1", "--diloco", "sync_every=5",
         "--eval-batches", "1", "--tensorboard", str(events), "--log-jsonl", str(lines)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert {"sync_outer_grad_norm", "sync_drift"} <= set(records[-1])  # the syncs applied by step 10
    board = EventAccumulator(str(events))
    board.Reload()
    assert {"sync/outer_grad_norm", "sync/drift"} <= set(board.Tags()["scalars"])


def test_a_missing_tensorboard_is_refused_before_any_worker_starts(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main(["train", "--tensorboard", str(tmp_path / "tb")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --tensorboard needs tensorboard, which is not installed: pip install 'shardwire[tensorboard]'")
