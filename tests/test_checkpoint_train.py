"""``shardwire train --checkpoint-dir``: a worker killed mid-run is restarted by torch's elastic
launcher and the job ends with exactly the parameters of an uninterrupted run; running the command
again resumes, skipping a corrupted newest checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import shardwire
from shardwire.engine.checkpoint import list_checkpoints
from shardwire.engine.checkpoint.claim import CLAIM

pytestmark = pytest.mark.slow

STEPS = 80
SAVE_EVERY = 10


def train_command(data: pathlib.Path, checkpoints: pathlib.Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", str(STEPS),
        "--batch", "4", "--data", str(data), "--eval-batches", "1", "--log-every", str(SAVE_EVERY),
        "--checkpoint-dir", str(checkpoints), "--save-every", str(SAVE_EVERY), "--keep", "2", *extra,
    ]


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def final_weights(checkpoints: pathlib.Path, out: pathlib.Path) -> dict:
    return torch.load(shardwire.export_state_dict(shardwire.checkpoint_path(checkpoints, STEPS), out))


def rank_file_checksums(checkpoints: pathlib.Path) -> dict:
    """The sha256 of every file: equal only if parameters, optimizer state and RNG states all are."""
    manifest = json.loads((shardwire.checkpoint_path(checkpoints, STEPS) / "manifest.json").read_text())
    return {f["name"]: f["sha256"] for f in manifest["files"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    sources = sorted(pathlib.Path(shardwire.__file__).parent.rglob("*.py"))
    path.write_text("".join(p.read_text() for p in sources))
    return path


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> pathlib.Path:
    checkpoints = tmp_path_factory.mktemp("uninterrupted")
    run(train_command(data, checkpoints))
    return checkpoints


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """Rank -> pid of the workers torch's launcher (running inside ``launcher``) has started."""
    children = pathlib.Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        env = dict(
            item.split("=", 1) for item in pathlib.Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers through /proc")
@pytest.mark.parametrize("signum, failed", [
    (signal.SIGKILL, "rank 1 (killed by SIGKILL: out of memory, or kill -9)"),
    # a worker that hangs (stopped): the collective rank 0 waits on times out, and the workers restart
    pytest.param(signal.SIGSTOP, "rank 0 (exit 3: a collective failed); any message it gave is above",
                 marks=pytest.mark.slow)])
def test_a_worker_that_dies_or_hangs_restarts_and_ends_like_an_uninterrupted_run(data, uninterrupted, tmp_path, signum,
                                                                                 failed):
    checkpoints = tmp_path / "checkpoints"
    launcher = subprocess.Popen(
        train_command(data, checkpoints, "--max-restarts", "1", "--timeout", "20"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
    )
    try:
        deadline = time.monotonic() + 180
        while not list_checkpoints(checkpoints):  # the first checkpoint is complete
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.01)
        os.kill(worker_pids(launcher)[1], signum)
        output, _ = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output
    assert f"step {STEPS}/{STEPS}" in output and "resuming from" in output, output  # it did restart
    assert f"note: worker processes failed: {failed}; starting them again (--max-restarts: restart 1 of 1)" in output, \
        output
    expected = final_weights(uninterrupted, tmp_path / "expected.pt")
    actual = final_weights(checkpoints, tmp_path / "actual.pt")
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[k], expected[k]) for k in expected)
    assert rank_file_checksums(checkpoints) == rank_file_checksums(uninterrupted)


def test_running_again_resumes_past_a_corrupted_checkpoint(data, uninterrupted, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted, checkpoints)
    newest = shardwire.checkpoint_path(checkpoints, STEPS) / "rank_00000.safetensors"
    damaged = bytearray(newest.read_bytes())
    damaged[-100] ^= 0xFF
    saved = newest.stat()
    newest.write_bytes(bytes(damaged))
    os.utime(newest, ns=(saved.st_atime_ns, saved.st_mtime_ns))  # rot, which no write time marks

    output = run(train_command(data, checkpoints))
    assert f"cannot resume from {shardwire.checkpoint_path(checkpoints, STEPS)}" in output
    assert "rank_00000.safetensors: its sha256 differs from the manifest's" in output
    assert f"resuming from {shardwire.checkpoint_path(checkpoints, STEPS - SAVE_EVERY)}" in output
    assert f"done: {SAVE_EVERY} steps" in output
    assert rank_file_checksums(checkpoints) == rank_file_checksums(uninterrupted)
    kept = [shardwire.checkpoint_path(checkpoints, step).name for step in (STEPS - SAVE_EVERY, STEPS)]
    assert sorted(p.name for p in checkpoints.iterdir()) == [CLAIM, *kept]  # --keep 2, and no temporaries


def test_a_checkpoint_past_the_last_step_is_a_clear_error(data, uninterrupted, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted, checkpoints)
    done = subprocess.run(train_command(data, checkpoints, "--steps", str(STEPS - 1)),
                          capture_output=True, text=True, timeout=240, env=_env())
    assert done.returncode != 0
    assert (f"{shardwire.checkpoint_path(checkpoints, STEPS)} is at step {STEPS}, past --steps {STEPS - 1}: "
            f"raise --steps to train on") in done.stdout + done.stderr
    assert rank_file_checksums(checkpoints) == rank_file_checksums(uninterrupted)  # nothing was touched
