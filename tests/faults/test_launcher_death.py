"""Workers die with their launcher: ``kill -9`` on ``shardwire train`` leaves no worker training."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]


def children(pid: int) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_killing_the_launcher_ends_its_workers(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardwire", "train", "--nproc", "2", "--model", "tiny", "--steps", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers := children(launcher.pid)) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            assert launcher.poll() is None, "the launcher ended early"
            time.sleep(0.5)
        time.sleep(3)  # well into training
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(alive(w) for w in workers):
            assert time.monotonic() < deadline, f"workers {[w for w in workers if alive(w)]} outlived their launcher"
            time.sleep(0.2)
    finally:
        for pid in [launcher.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
