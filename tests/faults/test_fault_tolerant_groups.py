"""A lost group costs its share, not the run (``shardwire.engine.fault_tolerance``): three groups, each
a ``shardwire train`` job of its own meeting at a torchft lighthouse every 5 steps. One is killed
(and a second while the first restarts) or hung; the others train on, never waiting long, and
torchrun's restart (or the hung group waking) brings it back with the others' state. Every run ends
with the three groups holding one model."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse below runs in this process
torchft = pytest.importorskip("torchft", reason="fault-tolerant groups need torchft (pip install 'shardwire[ft]')")
from torchft.coordination import LighthouseServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

STEPS, EVERY, TIMEOUT = 1000, 5, 5  # TIMEOUT: seconds a sync waits for a group that stopped mid-sync
HEARTBEAT_MS = 1500  # the lighthouse leaves out a group silent for this long
GAP_BOUND = 45.0  # seconds between two progress records of a live group: the faults' cost, with room for a busy CI


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    yield server.address()
    server.shutdown()


class Group:
    """One group's ``shardwire train`` job, restarted once by torchrun if its worker dies."""

    def __init__(self, name: str, lighthouse: str, tmp: pathlib.Path):
        self.name, self.log, self.out = name, tmp / f"{name}.jsonl", tmp / f"{name}.out"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", str(STEPS), "--log-every", "5",
             "--layout", "hybrid", "--diloco", f"sync_every={EVERY}", "--nproc", "1", "--max-restarts", "1",
             "--fault-tolerance", f"lighthouse={lighthouse},group={name},timeout={TIMEOUT}",
             "--log-jsonl", str(self.log)],
            stdout=self.out.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.seen: list[tuple[float, int]] = []  # (when, step) of each progress record, as polled

    def records(self) -> list[dict]:
        try:
            return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        except (OSError, json.JSONDecodeError):
            return []

    def poll(self) -> int:
        steps = [record["step"] for record in self.records()]
        if steps and (not self.seen or self.seen[-1][1] != steps[-1]):
            self.seen.append((time.monotonic(), steps[-1]))
        return steps[-1] if steps else 0

    def worker(self) -> int:
        """The training process under torchrun (``python -u -m shardwire train``) of this group."""
        found = subprocess.run(["pgrep", "-f", f"python.* -u -m shardwire train.*group={self.name},"], capture_output=True,
                               text=True).stdout.split()
        assert found, f"group {self.name} has no worker"
        return int(found[0])

    def validation_loss(self) -> str:
        found = re.findall(r"validation loss (\S+)", self.out.read_text())
        assert found, f"group {self.name} did not finish:\n{self.out.read_text()[-3000:]}"
        return found[-1]

    def stop(self) -> None:
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait()


def run_groups(lighthouse: str, tmp: pathlib.Path, fault, *, deadline: float = 400.0) -> list[Group]:
    """Start three groups, call ``fault(groups)`` once the last has passed step 20, wait for all."""
    groups = [Group(name, lighthouse, tmp) for name in ("a", "b", "c")]
    try:
        start, faulted = time.monotonic(), False
        while any(group.launcher.poll() is None for group in groups):
            assert time.monotonic() - start < deadline, "the groups did not finish in time"
            steps = [group.poll() for group in groups]
            if not faulted and min(steps) >= 20:
                fault(groups)
                faulted = True
            time.sleep(0.2)
        assert faulted, "the run ended before the fault"
        for group in groups:
            assert group.launcher.returncode == 0, f"group {group.name} failed:\n{group.out.read_text()[-3000:]}"
        return groups
    finally:
        for group in groups:
            group.stop()


def check_outcome(groups: list[Group], lost: Group) -> None:
    """The others never waited long, averaged without the lost group at some sync, and it came back
    with their state; every group ends with the same model (the same validation loss, on batches
    that do not depend on the group)."""
    survivors = [group for group in groups if group is not lost]
    for group in survivors:
        gaps = [later - earlier for (earlier, _), (later, _) in zip(group.seen, group.seen[1:])]
        assert max(gaps) < GAP_BOUND, f"group {group.name} waited {max(gaps):.0f}s between two progress records"
        assert any(record.get("sync_groups", 3) < 3 for record in group.records()), \
            f"group {group.name} never synced without {lost.name}"
    assert any(record.get("sync_recovered", 0) >= 1 for record in lost.records()), \
        f"group {lost.name} never received the others' state:\n{lost.out.read_text()[-3000:]}"
    assert {group.validation_loss() for group in groups} == {groups[0].validation_loss()}


def test_a_hung_group_is_left_out_and_rejoins_when_it_wakes(lighthouse, tmp_path):
    def hang(groups):
        worker = groups[2].worker()
        os.kill(worker, signal.SIGSTOP)
        time.sleep(4 * HEARTBEAT_MS / 1000 + TIMEOUT)
        os.kill(worker, signal.SIGCONT)

    groups = run_groups(lighthouse, tmp_path, hang)
    check_outcome(groups, groups[2])


def test_a_killed_group_rejoins_and_so_does_a_second_lost_while_it_restarts(lighthouse, tmp_path):
    """Group c's worker is killed; while torchrun restarts it, group b's is killed too: a trains on
    alone, and both restarts rejoin with its state."""

    def kill_twice(groups):
        lost = groups[2].worker()
        os.kill(lost, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # until torchrun has started its replacement
            try:
                if groups[2].worker() != lost:
                    break
            except AssertionError:
                pass
            assert time.monotonic() < deadline, "group c was not restarted"
            time.sleep(0.2)
        os.kill(groups[1].worker(), signal.SIGKILL)

    groups = run_groups(lighthouse, tmp_path, kill_twice)
    check_outcome(groups, groups[2])
    assert any(record.get("sync_groups") == 1 for record in groups[0].records()), "group a never synced alone"
    assert any(record.get("sync_recovered", 0) >= 1 for record in groups[1].records()), \
        "group b never received the others' state"
