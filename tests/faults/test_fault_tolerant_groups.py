"""A lost group costs its share, not the run (``shardwire.engine.fault_tolerance``): three groups, each
a ``shardwire train`` job of its own meeting at a torchft lighthouse every 5 steps, on this machine
or, as root, on three nodes of an emulated cluster at 100 Mbit/s (``shardwire testbed``). One is
killed (and a second while the first restarts), hung or cut off the network; the others train on,
never waiting long, and torchrun's restart (the hung group waking, the link coming back) brings it
back with the others' state. Every run ends with the three groups holding one model. Groups that
meet at every step instead (no DiLoCo) survive a kill the same way."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from shardwire.testbed import network, spec

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse below runs in this process
torchft = pytest.importorskip("torchft", reason="fault-tolerant groups need torchft (pip install 'shardwire[ft]')")
from torchft.coordination import LighthouseServer  # noqa: E402

# Each test bounds its own run (``run_groups``' deadline, 900 s at most): pytest's limit is above it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

STEPS, EVERY, TIMEOUT = 1000, 5, 5  # TIMEOUT: seconds a sync waits for a group that stopped mid-sync
PACE_STEPS = 300  # the run that measures this machine's pace
HEARTBEAT_MS = 1500  # the lighthouse leaves out a group silent for this long
GAP_BOUND = 45.0  # seconds between two progress records of a live group: the faults' cost, with room for a busy CI
CUT_S = 60.0  # how long a node's link is down
SAVE_EVERY = 10


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    yield server.address()
    server.shutdown()


@pytest.fixture(scope="module")
def pace(tmp_path_factory) -> float:
    """Steps per second of three groups syncing every ``EVERY`` steps on this machine, from a short
    run without faults: a test's run is made long enough in time to outlast its faults (``lasting``),
    on a fast machine as on a loaded one."""
    server = LighthouseServer(bind="[::]:0", min_replicas=3, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        groups = run_groups([Group(name, server.address(), tmp_path_factory.mktemp("pace"), steps=PACE_STEPS)
                             for name in ("a", "b", "c")], lambda groups: iter(()), start_at=0)
    finally:
        server.shutdown()
    step_times = [record["step_time_s"] for group in groups for record in group.records()[1:]]
    return 1 / (sum(step_times) / len(step_times))


def lasting(pace: float, seconds: float, steps: int = STEPS) -> int:
    """Steps that keep groups going at ``pace`` for ``seconds`` at least, and no fewer than ``steps``."""
    return max(steps, round(pace * seconds))


@pytest.fixture
def cluster(tmp_path):
    """Three emulated nodes at 100 Mbit/s, with a lighthouse on the first, as on a cluster."""
    if os.geteuid() != 0:
        pytest.skip("needs root: builds network namespaces, links and qdiscs")
    bed = spec.Testbed("shardwire-ft", 3, 100 * 10**6)
    network.up(bed)
    server = subprocess.Popen(
        [sys.executable, "-m", "shardwire", "testbed", "exec", "--name", bed.name, "node0", "--", "torchft_lighthouse",
         "--min_replicas", "1", "--join_timeout_ms", "60000", "--heartbeat_timeout_ms", str(HEARTBEAT_MS)],
        stdout=(tmp_path / "lighthouse.out").open("w"), stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
    try:
        time.sleep(1)
        assert server.poll() is None, f"the lighthouse did not start:\n{(tmp_path / 'lighthouse.out').read_text()}"
        yield bed, f"{bed.namespace(0)}:29510"  # torchft_lighthouse's port
    finally:
        server.kill()
        server.wait()
        network.down(bed.name)


class Group:
    """One group's ``shardwire train`` job, restarted once by torchrun if its worker dies; on
    ``node`` of ``testbed`` (and named after it, by default) where given."""

    def __init__(self, name: str, lighthouse: str, tmp: pathlib.Path, *, steps: int = STEPS,
                 testbed: spec.Testbed | None = None, node: int = 0, checkpoints: pathlib.Path | None = None,
                 save_every: int = SAVE_EVERY, keep: int = 3, every_step: bool = False):
        settings = f"lighthouse={lighthouse},timeout={TIMEOUT}"
        on_node = []
        if testbed is None:
            settings += f",group={name}"
        else:
            on_node = [sys.executable, "-m", "shardwire", "testbed", "exec", "--name", testbed.name, f"node{node}", "--"]
        self.name, self.log, self.out = name, tmp / f"{name}.jsonl", tmp / f"{name}.out"
        saving = [] if checkpoints is None else ["--checkpoint-dir", str(checkpoints), "--save-every", str(save_every),
                                                 "--keep", str(keep)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        self.launcher = subprocess.Popen(
            [*on_node, sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--steps", str(steps),
             "--log-every", "5", "--layout", "hybrid", *([] if every_step else ["--diloco", f"sync_every={EVERY}"]),
             "--nproc", "1",
             "--max-restarts", "1", "--fault-tolerance", settings, "--log-jsonl", str(self.log), *saving],
            stdout=self.out.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.seen: list[tuple[float, int]] = []  # (when, step) of each progress record, as polled
        self.lost = False  # stopped for good

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

    def recoveries(self) -> int:
        """How many times this group has received the others' state."""
        return sum(record.get("sync_recovered", 0) for record in self.records())

    def restarted(self, lost: int) -> bool:
        """Whether torchrun has started a worker in place of process ``lost``."""
        try:
            return self.worker() != lost
        except AssertionError:  # between the two
            return False

    def validation_loss(self) -> str:
        found = re.findall(r"validation loss (\S+)", self.out.read_text())
        assert found, f"group {self.name} did not finish:\n{self.out.read_text()[-3000:]}"
        return found[-1]

    def stop(self) -> None:
        """Stop the group for good: its launcher and every process under it."""
        self.lost = True
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait()


def run_groups(groups: list[Group], fault, *, deadline: float = 400.0, start_at: int = 20) -> list[Group]:
    """Once the last of ``groups`` has passed step ``start_at``, run ``fault(groups)``, a generator
    that yields while it waits (the groups' progress is polled meanwhile); wait for all the groups."""
    try:
        start, faults, done = time.monotonic(), None, False
        while any(group.launcher.poll() is None for group in groups):
            assert time.monotonic() - start < deadline, "the groups did not finish in time"
            steps = [group.poll() for group in groups]
            if faults is None and min(steps) >= start_at:
                faults = fault(groups)
            if faults is not None and not done:
                done = next(faults, StopIteration) is StopIteration
            time.sleep(0.2)
        assert done, "the run ended before the faults did"
        for group in groups:
            assert group.launcher.returncode == 0 or group.lost, \
                f"group {group.name} failed:\n{group.out.read_text()[-3000:]}"
        return groups
    finally:
        for group in groups:
            group.stop()


def check_outcome(groups: list[Group], *lost: Group) -> None:
    """The others never waited long, averaged without the lost groups at some sync (or dropped one
    they failed), and these came back with their state; every group ends with the same model (the
    same validation loss, on batches that do not depend on the group)."""
    survivors = [group for group in groups if group not in lost]
    for group in survivors:
        gaps = [later - earlier for (earlier, _), (later, _) in zip(group.seen, group.seen[1:])]
        assert max(gaps) < GAP_BOUND, f"group {group.name} waited {max(gaps):.0f}s between two progress records"
        # a restart quicker than the lighthouse's heartbeat timeout is back before any quorum leaves it
        # out: the failure then shows as the sync or step it struck, dropped
        assert any(record.get("sync_groups", 3) < 3 or record.get("sync_dropped", 0) for record in group.records()), \
            f"group {group.name} never synced without the lost groups, nor dropped a sync they failed"
    for group in lost:
        assert group.recoveries(), f"group {group.name} never received the others' state:\n{group.out.read_text()[-3000:]}"
        # what it received: at least the anchor and outer momentum of the tiny GPT's 47,104 fp32 parameters
        assert sum(record.get("sync_recovery_bytes", 0) for record in group.records()) >= 47_104 * 4 * 2
    assert {group.validation_loss() for group in groups} == {groups[0].validation_loss()}


def wait_for(condition, seconds: float, what: str):
    """Yield until ``condition()`` holds; fail with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        yield


def pause(seconds: float):
    """Yield for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        yield


def test_a_hung_group_is_left_out_and_rejoins_when_it_wakes(lighthouse, pace, tmp_path):
    def hang(groups):
        worker = groups[2].worker()
        os.kill(worker, signal.SIGSTOP)
        yield from pause(4 * HEARTBEAT_MS / 1000 + TIMEOUT)
        os.kill(worker, signal.SIGCONT)

    groups = run_groups([Group(name, lighthouse, tmp_path, steps=lasting(pace, 60)) for name in ("a", "b", "c")], hang)
    check_outcome(groups, groups[2])


def test_a_killed_group_rejoins_and_so_does_a_second_lost_while_it_restarts(lighthouse, pace, tmp_path):
    """Group c's worker is killed; while torchrun restarts it, group b's is killed too: a trains on
    alone, and both restarts rejoin with its state."""

    def kill_twice(groups):
        lost = groups[2].worker()
        os.kill(lost, signal.SIGKILL)
        yield from wait_for(lambda: groups[2].restarted(lost), 120, "group c was not restarted")
        os.kill(groups[1].worker(), signal.SIGKILL)

    groups = run_groups([Group(name, lighthouse, tmp_path, steps=lasting(pace, 90)) for name in ("a", "b", "c")],
                        kill_twice)
    check_outcome(groups, groups[2])
    assert any(record.get("sync_groups") == 1 for record in groups[0].records()), "group a never synced alone"
    assert any(record.get("sync_recovered", 0) >= 1 for record in groups[1].records()), \
        "group b never received the others' state"


def test_groups_meeting_at_every_step_drop_the_step_a_group_is_killed_in_and_its_restart_rejoins(lighthouse,
                                                                                                   tmp_path):
    """Fault-tolerant HSDP (no DiLoCo: the groups average gradients at every step): group c's worker
    is killed; the others drop the step it struck and train on, and its restart rejoins with their
    parameters and optimizer state."""

    def kill(groups):
        before = groups[2].recoveries()  # a group that starts late is recovered too
        os.kill(groups[2].worker(), signal.SIGKILL)
        yield from wait_for(lambda: groups[2].recoveries() > before, 120, "group c's restart did not rejoin")

    groups = run_groups([Group(name, lighthouse, tmp_path, steps=STEPS // 2, every_step=True)
                         for name in ("a", "b", "c")], kill)
    check_outcome(groups, groups[2])
    # the restart's count of steps is of those it took, not those its recovery moved it past
    said = groups[2].out.read_text()
    restart = said[said.rindex("shardwire train: "):]
    skipped = sum(int(steps) for steps in re.findall(r"\((\d+) steps on", restart))
    assert int(re.search(r"done: (\d+) steps", restart).group(1)) + skipped == STEPS // 2, restart[-3000:]


@pytest.mark.root
@pytest.mark.timeout(960)
def test_on_an_emulated_cluster_a_killed_node_and_a_cut_off_node_rejoin(cluster, pace, tmp_path):
    """On three nodes at 100 Mbit/s, each a group: node2's worker is killed and, once its restart has
    rejoined, node1's link is cut for a minute. The others train on through both, and each lost node
    comes back with their state."""
    bed, lighthouse = cluster

    def kill_then_cut(groups):
        before = groups[2].recoveries()  # a group that starts late is recovered too
        os.kill(groups[2].worker(), signal.SIGKILL)
        yield from wait_for(lambda: groups[2].recoveries() > before, 120, "node2's restart did not rejoin")
        network.set_link(bed, 1, up=False)
        try:
            yield from pause(CUT_S)
        finally:
            network.set_link(bed, 1, up=True)

    # long enough to outlast the restart, the cut and node1's reconnection (HTTP/2's 80 s): the others
    # step on while node1 is away
    steps = lasting(pace, 120 + CUT_S + 80 + 60, 3 * STEPS)
    groups = run_groups([Group(bed.namespace(k), lighthouse, tmp_path, steps=steps, testbed=bed, node=k)
                         for k in range(3)], kill_then_cut, deadline=900.0)
    check_outcome(groups, groups[2], groups[1])


def test_a_group_whose_final_sync_meets_fewer_groups_says_it_ends_apart(lighthouse, pace, tmp_path):
    """A group that outlives a group lost for good syncs alone at its end: its model is its own, which
    it says. The other is stopped for good once the two have synced together (with a lighthouse
    that needs one group, a group whose workers start later may sync alone at first), and the one
    left runs on to sync alone after it: 20 s of steps at the pace of three groups on this machine,
    more than enough for one."""
    def lose_a(groups):
        a, b = groups
        yield from wait_for(lambda: any(record.get("sync_groups") == 2 for record in b.records()), 120,
                            "the two groups never synced together")
        a.stop()

    steps = lasting(pace, 20, 200)
    groups = run_groups([Group("a", lighthouse, tmp_path, steps=steps), Group("b", lighthouse, tmp_path, steps=steps)],
                        lose_a, start_at=0)
    said = groups[1].out.read_text()
    assert "warning: this group's final sync met 1 group(s), where 2 met before: the groups do not end as one " \
           "model" in said, said[-3000:]


def test_a_group_resumed_after_the_others_ended_says_it_ends_apart(tmp_path):
    """A group restarted from its checkpoint after the others ended meets none of them: its checkpoint
    remembers that two groups met, so it says that it ends apart, as a group that outlives the
    others in one run does. The first lighthouse waits for both groups, the second for one."""
    for logs, names, steps in (("together", ("a", "b"), 10), ("alone", ("a",), 20)):
        (tmp_path / logs).mkdir()
        server = LighthouseServer(bind="[::]:0", min_replicas=len(names), join_timeout_ms=60_000,
                                  heartbeat_timeout_ms=HEARTBEAT_MS)
        try:
            run_groups([Group(name, server.address(), tmp_path / logs, steps=steps,
                              checkpoints=tmp_path / "checkpoints") for name in names],
                       lambda groups: iter(()), start_at=0)
        finally:
            server.shutdown()
    said = (tmp_path / "alone" / "a.out").read_text()
    assert "warning: this group's final sync met 1 group(s), where 2 met before" in said, said[-3000:]


def test_a_group_run_again_after_its_last_step_keeps_the_model_the_groups_ended_with(tmp_path):
    """Run again from its last checkpoint (a rerun, or torchrun's restart after it saved), a group
    trains nothing and meets no group: a join would sync alone, and the outer momentum alone would
    move the model the groups ended with."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        (tmp_path / "first").mkdir()
        first = run_groups([Group(name, server.address(), tmp_path / "first", steps=10,
                                  checkpoints=tmp_path / "checkpoints") for name in ("a", "b")],
                           lambda groups: iter(()), start_at=0)
    finally:
        server.shutdown()
    (tmp_path / "again").mkdir()
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        again, = run_groups([Group("a", server.address(), tmp_path / "again", steps=10,
                                   checkpoints=tmp_path / "checkpoints")], lambda groups: iter(()), start_at=0)
    finally:
        server.shutdown()
    said = again.out.read_text()
    assert "done: 0 steps" in said and "warning" not in said, said[-3000:]
    assert again.validation_loss() == first[0].validation_loss()


def test_a_restart_of_every_group_resumes_exactly_and_one_whose_checkpoint_is_older_recovers(tmp_path):
    """Every group killed and started again: from checkpoints of the same step they continue as if
    never stopped (the same model as an uninterrupted run, bit for bit); a group whose newest
    checkpoint is older than the others' (it was down when they saved) counts fewer syncs, so it is
    behind at its first sync and recovers their state rather than averaging from another anchor.
    The lighthouse waits for both groups, so that neither syncs alone at the start."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    lighthouse, steps = server.address(), 120

    def start(logs: str, checkpoints: str) -> list[Group]:
        (tmp_path / logs).mkdir()
        return [Group(name, lighthouse, tmp_path / logs, steps=steps, checkpoints=tmp_path / checkpoints)
                for name in ("a", "b")]

    def saved(checkpoints: str, group: str) -> set[str]:
        return {path.name for path in (tmp_path / checkpoints / group).glob("step_*")}

    try:
        whole = run_groups(start("whole", "whole"), lambda groups: iter(()), start_at=0)
        killed = start("killed", "stopped")
        try:
            deadline = time.monotonic() + 120
            while not saved("stopped", "a") & saved("stopped", "b"):
                assert time.monotonic() < deadline, "the groups saved no checkpoint of the same step"
                time.sleep(0.1)
        finally:
            for group in killed:
                group.stop()
        common = max(saved("stopped", "a") & saved("stopped", "b"))
        for group in ("a", "b"):  # both resume from the same step
            for newer in saved("stopped", group) - {name for name in saved("stopped", group) if name <= common}:
                shutil.rmtree(tmp_path / "stopped" / group / newer)
        shutil.copytree(tmp_path / "stopped", tmp_path / "older")
        shutil.rmtree(tmp_path / "older" / "b" / common)  # b was down when a saved it
        resumed = run_groups(start("resumed", "stopped"), lambda groups: iter(()), start_at=0)
        for before, after in zip(whole, resumed):  # the last steps' loss, to the bit, and the final model's
            assert (after.records()[-1]["loss"], after.validation_loss()) == (before.records()[-1]["loss"],
                                                                            before.validation_loss())
        assert not any(group.recoveries() for group in resumed)
        older = run_groups(start("resumed-older", "older"), lambda groups: iter(()), start_at=0)
        assert older[1].recoveries() and not older[0].recoveries()
        assert older[0].validation_loss() == older[1].validation_loss()
    finally:
        server.shutdown()


def test_groups_given_more_steps_after_their_final_sync_train_on_as_one_uninterrupted_run(tmp_path):
    """Every group resumed from the checkpoint of its final sync with more --steps: that sync is
    taken already, and the groups meet at the next one (a join syncing again moved the model by a
    step of outer momentum: 0.7 nat worse by the end, silently). Within the warmup, where the
    learning rate does not depend on --steps, they end as a run of the more steps does, bit for
    bit."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        def run(logs: str, steps: int, checkpoints: str) -> list[Group]:
            (tmp_path / logs).mkdir()
            return run_groups([Group(name, server.address(), tmp_path / logs, steps=steps,
                                     checkpoints=tmp_path / checkpoints) for name in ("a", "b")],
                              lambda groups: iter(()), start_at=0)

        whole = run("whole", 20, "whole-checkpoints")
        run("first", 10, "checkpoints")
        extended = run("extended", 20, "checkpoints")
    finally:
        server.shutdown()
    for before, after in zip(whole, extended):
        assert "this run changes --steps 10 -> 20" in after.out.read_text()
        assert (after.records()[-1]["loss"], after.validation_loss()) == (before.records()[-1]["loss"],
                                                                        before.validation_loss())


def test_a_group_back_with_as_many_syncs_but_fewer_steps_recovers(tmp_path):
    """A group killed during a sync that the others then dropped comes back from a checkpoint saved
    before that sync: it has committed as many syncs as they have, and done fewer steps. Staged from
    checkpoints between the same two syncs of a run syncing every 5 steps: a's of step 4, b's of
    step 5, whose sync is due. a is behind: it recovers b's state and schedule at its first sync,
    instead of averaging with b a sync behind b's schedule and ending alone 5 steps later, and
    the groups end as one model, neither saying its final sync met fewer groups."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=HEARTBEAT_MS)
    lighthouse, checkpoints = server.address(), tmp_path / "checkpoints"

    def start(logs: str) -> list[Group]:
        (tmp_path / logs).mkdir()
        return [Group(name, lighthouse, tmp_path / logs, steps=20, checkpoints=checkpoints, save_every=1, keep=0)
                for name in ("a", "b")]

    try:
        run_groups(start("first"), lambda groups: iter(()), start_at=0)
        for group, newest in (("a", 4), ("b", 5)):
            for path in (checkpoints / group).glob("step_*"):
                if int(path.name.removeprefix("step_")) > newest:
                    shutil.rmtree(path)
        # apart, a would wait alone for its last sync: the lighthouse waits for two groups
        a, b = run_groups(start("resumed"), lambda groups: iter(()), start_at=0, deadline=180)
        assert a.recoveries() and not b.recoveries(), a.out.read_text()[-3000:]
        assert "done: 15 steps" in a.out.read_text()  # those it took, from b's step 5
        assert a.validation_loss() == b.validation_loss()
        for group in (a, b):
            assert "final sync met" not in group.out.read_text(), group.out.read_text()[-3000:]
    finally:
        server.shutdown()
