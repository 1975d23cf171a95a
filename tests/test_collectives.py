"""The communicator: exact collectives on every placement of ranks on nodes, one transport per process
group, ranks that disagree caught, long waits said, and what its records say."""

from __future__ import annotations

import contextlib
import datetime
import io
import threading
import time

import pytest
import torch

from harness import run_workers
from shardwire.comm.clock import Clock
from shardwire.comm.notice import WaitNotice
from shardwire.comm.records import CommRecord
from shardwire.profile.comm import CommSummary

TIMEOUT = datetime.timedelta(seconds=60)


def exact_collectives(rank, world, dtype_name):
    import torch.distributed as dist

    from shardwire.comm.communicator import Communicator

    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    dtype = getattr(torch, dtype_name)
    size = 5  # elements per shard: odd, so slots do not line up with anything by accident
    shards = [torch.arange(size, dtype=dtype) + 100 * r for r in range(world)]
    gathered = [torch.empty(size * world, dtype=dtype) for _ in range(3)]
    # several collectives in flight at once, so their messages must not be confused
    pending = [comm.all_gather(out, shards[rank] + i, tag=f"ag{i}") for i, out in enumerate(gathered)]
    fulls = [torch.arange(size * world, dtype=dtype) * (rank + 1 + i) for i in range(2)]
    shares = [torch.empty(size, dtype=dtype) for _ in range(2)]
    pending += [comm.reduce_scatter(share, full, tag=f"rs{i}") for i, (share, full) in enumerate(zip(shares, fulls))]
    mean = torch.empty(size, dtype=dtype)
    pending.append(comm.reduce_scatter(mean, torch.full((size * world,), float(rank)).to(dtype), tag="mean",
                                       average=True))
    for p in pending:
        p.wait()
    for i, out in enumerate(gathered):
        assert torch.equal(out, torch.cat(shards) + i), f"all_gather {i}"
    ranks_sum = world * (world + 1) // 2
    for i, share in enumerate(shares):
        expected = torch.arange(rank * size, (rank + 1) * size, dtype=dtype) * (ranks_sum + world * i)
        assert torch.equal(share, expected), f"reduce_scatter {i}: {share} != {expected}"
    assert torch.allclose(mean.float(), torch.full((size,), (world - 1) / 2), rtol=1e-2)
    # all-reduces of any length (pieces of unequal length, some empty: nothing is sent for those)
    for length in (1, 7, size * world):
        for op in ("sum", "avg", "max"):
            values = (torch.arange(length) + 3 * rank).to(dtype)
            comm.all_reduce(values, tag=f"ar {op} {length}", op=op).wait()
            everyone = torch.stack([torch.arange(length) + 3 * r for r in range(world)]).float()
            expected = {"sum": everyone.sum(0), "avg": everyone.mean(0), "max": everyone.max(0).values}[op]
            assert torch.allclose(values.float(), expected, rtol=1e-2), (op, length)
    # an all-reduce on another communicator, started once the reduce-scatter that feeds it is done
    other = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    share = torch.empty(size, dtype=dtype)
    scattered = comm.reduce_scatter(share, torch.ones(size * world, dtype=dtype), tag="feeds")
    summed = other.all_reduce(share, tag="fed", after=scattered)
    summed.wait()
    scattered.wait()
    assert torch.equal(share, torch.full((size,), float(world * world), dtype=dtype))
    other.close()
    comm.close()
    return comm.placement.ranks_per_node


@pytest.mark.slow
@pytest.mark.parametrize("world, per_node", [(4, 1), (4, 2), (4, 4), (3, 1), (6, 3)])
def test_all_gather_and_reduce_scatter_are_exact_on_any_placement(world, per_node):
    placements = run_workers(world, exact_collectives, "float32", env={"LOCAL_WORLD_SIZE": str(per_node)})
    assert placements == [per_node] * world


def slurm_task(rank, world):
    """A task of the SLURM step, told its rank as srun tells each task its own."""
    import os

    os.environ["SLURM_PROCID"] = str(rank)
    return exact_collectives(rank, world, "float32")


@pytest.mark.slow
def test_the_placement_of_an_srun_step_without_torchrun_is_slurm_s(monkeypatch):
    """`srun --nodes 2 --ntasks-per-node 2 python train.py`, whose script makes its process group from
    SLURM's variables: no torchrun, so no LOCAL_WORLD_SIZE, and the transport places its ranks on
    SLURM's 2 nodes of 2, where its collectives are exact."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    step = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_DISTRIBUTION": "block"}
    assert run_workers(4, slurm_task, env=step) == [2] * 4


def test_a_group_of_one_copies_at_once():
    """Alone in its group, a rank's collectives are local copies made on the calling thread: the
    same values, complete when issued."""
    assert run_workers(1, exact_collectives, "float32") == [1]


@pytest.mark.slow
def test_low_precision_buffers():
    run_workers(4, exact_collectives, "bfloat16", env={"LOCAL_WORLD_SIZE": "2"})


def posting_order(rank, world):
    """Each point-to-point step's messages, in the order they were posted: a step ends at a wait."""
    import torch.distributed as dist

    from shardwire.comm import exchange
    from shardwire.comm.communicator import Communicator

    posted = []
    for kind in ("send", "recv"):
        original = getattr(exchange.Exchange, kind)

        def post(self, tensor, peer, slot, kind=kind, original=original):
            posted.append(kind)
            return original(self, tensor, peer, slot)

        setattr(exchange.Exchange, kind, post)
    wait = exchange.Exchange.wait

    def step_ends(self, works):
        posted.append("wait")
        wait(self, works)

    exchange.Exchange.wait = step_ends
    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    size = 6
    comm.all_gather(torch.empty(size * world), torch.ones(size), tag="ag").wait()
    comm.reduce_scatter(torch.empty(size), torch.ones(size * world), tag="rs").wait()
    comm.all_reduce(torch.ones(size * world), tag="ar").wait()
    comm.close()
    return " ".join(posted).split("wait")


@pytest.mark.slow
def test_every_step_posts_its_receives_before_its_sends():
    """A pair of ranks that each sent before receiving took turns on their link instead of using both
    directions at once (exchange.py): every step, within and across nodes, posts receives first."""
    for steps in run_workers(4, posting_order, env={"LOCAL_WORLD_SIZE": "2"}):
        assert len(steps) > 6
        for step in steps:
            kinds = step.split()
            assert "send" not in kinds or "recv" not in kinds[kinds.index("send"):], step


# ------------------------------------------------------------------ one transport per group


def interleaved_groups(rank, world):
    """Two groups over the same ranks, each with its communicator, used in opposite orders on the
    two ranks, with several collectives of each in flight; plus a second communicator over the
    first group, whose messages must not meet the first one's."""
    import torch.distributed as dist

    from shardwire.comm.communicator import Communicator

    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    comms = [Communicator(g, torch.device("cpu"), timeout=TIMEOUT) for g in groups]
    comms.append(Communicator(groups[0], torch.device("cpu"), timeout=TIMEOUT))
    order = [0, 1, 2] if rank == 0 else [2, 1, 0]
    outputs, pending = {}, []
    for step in range(3):
        for which in order:
            out = torch.empty(2 * 1000)
            pending.append(comms[which].all_gather(out, torch.full((1000,), 10.0 * which + rank + step),
                                                   tag=f"step {step}"))
            share = torch.empty(1000)
            pending.append(comms[which].reduce_scatter(share, torch.full((2000,), float(which + step)),
                                                       tag=f"step {step}"))
            outputs[(which, step)] = (out, share)
        if rank == 1:
            time.sleep(0.05)  # let the ranks drift apart
    for p in pending:
        p.wait()
    for (which, step), (out, share) in outputs.items():
        expected = torch.cat([torch.full((1000,), 10.0 * which + r + step) for r in range(2)])
        assert torch.equal(out, expected), (which, step)
        assert torch.equal(share, torch.full((1000,), 2.0 * (which + step))), (which, step)
    for comm in comms:
        comm.close()
    return True


@pytest.mark.slow
def test_process_groups_issue_collectives_in_any_interleaving():
    assert run_workers(2, interleaved_groups, timeout=120) == [True, True]


# ---------------------------------------------------------------------------- agreement


def mismatched_collectives(rank, world):
    import torch.distributed as dist

    from shardwire.comm.communicator import Communicator
    from shardwire.comm.errors import ScheduleMismatchError

    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    out = torch.empty(4 * world)
    try:
        comm.all_gather(out, torch.zeros(4), tag="blocks.1" if rank == 0 else "blocks.2").wait()
    except ScheduleMismatchError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_ranks_running_different_collectives_are_told_which():
    messages = run_workers(3, mismatched_collectives, timeout=120)
    for message in messages:
        assert "rank 0 is running all_gather of 'blocks.1'" in message
        assert "rank 2 is running all_gather of 'blocks.2'" in message


def order_verified(rank, world):
    import torch.distributed as dist

    from shardwire.comm.communicator import Communicator
    from shardwire.comm.errors import ScheduleMismatchError

    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    tensor = torch.ones(3)
    comm.broadcast(tensor, tag="same").wait()
    comm.verify_order("step 1")  # agreed so far
    # A broadcast (gloo's own) is not checked message by message: the running hash is what catches it.
    comm.broadcast(tensor, tag="initial values" if rank == 0 else "something else").wait()
    try:
        comm.verify_order("step 2")
    except ScheduleMismatchError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_verify_order_catches_collectives_that_differ_between_checks():
    for message in run_workers(2, order_verified, timeout=120):
        assert "ranks issued different collectives, or loaded weights (load_state_dict) on some ranks and not " \
               "others, in step 2" in message


# ------------------------------------------------------------------------------- long waits


def a_late_rank(rank, world):
    """Rank 1 joins the gather 4 s late; a wait is long after 1 s."""
    import torch.distributed as dist

    from shardwire.comm import communicator
    from shardwire.comm.communicator import Communicator

    communicator.LONG_WAIT = datetime.timedelta(seconds=1.0)
    said = io.StringIO()
    comm = Communicator(dist.group.WORLD, torch.device("cpu"), timeout=TIMEOUT)
    out = torch.empty(2 * world)
    with contextlib.redirect_stderr(said):
        if rank == 1:
            time.sleep(4.0)
        comm.all_gather(out, torch.zeros(2), tag="blocks.1").wait()
        time.sleep(1.5)  # a wait that ended is not said after
    return said.getvalue()


@pytest.mark.slow
def test_a_long_wait_for_a_collective_is_said_once_while_it_lasts():
    """A peer gone or a link cut left the others silent for the whole deadline, ten minutes by default."""
    waiting, late = run_workers(2, a_late_rank, timeout=120)
    assert late == ""
    [line] = waiting.splitlines()
    assert line.startswith("warning: rank 0: all_gather of 'blocks.1' has waited ")
    assert line.endswith("s for the other ranks: one may have stopped, or lost its link; it fails at 60s")


class _Listener:
    """What a notice said, as (seconds waited, what)."""

    def __init__(self):
        self.said = []

    def say(self, waited, what):
        self.said.append((waited, what))


def test_a_wait_is_said_at_each_interval_while_it_lasts_and_a_short_one_never():
    """A lighthouse gone (or the groups it waits for) leaves a group waiting up to its quorum timeout:
    it says so at each interval, not only at the end."""
    listener = _Listener()
    before = set(threading.enumerate())
    notice = WaitNotice(datetime.timedelta(seconds=0.2), listener.say)
    watching = set(threading.enumerate()) - before
    with notice.waiting("a"):
        time.sleep(0.02)
    time.sleep(0.5)
    assert listener.said == []
    with notice.waiting("b"):
        time.sleep(1.0)
    waits = [waited for waited, _ in listener.said]
    assert len(waits) >= 2 and all(waited >= 0.2 for waited in waits) and waits == sorted(waits)
    assert {what for _, what in listener.said} == {"b"}
    del listener  # what it told: its thread ends with it
    with notice.waiting("c"):
        time.sleep(0.5)
    assert watching and not any(thread.is_alive() for thread in watching)


def test_a_wait_said_once_is_said_once_each_time_under_its_own_name():
    """A collective's wait is said once: at every interval, every rank of a job would repeat it."""
    listener = _Listener()
    notice = WaitNotice(datetime.timedelta(seconds=0.2), listener.say, repeat=False)
    for what in ("blocks.1", "blocks.2"):
        with notice.waiting(what):
            time.sleep(1.0)
    with notice.waiting("short"):
        time.sleep(0.02)
    time.sleep(0.3)
    assert [what for _, what in listener.said] == ["blocks.1", "blocks.2"]
    assert all(waited >= 0.2 for waited, _ in listener.said)


# ------------------------------------------------------------------------------- records


def test_records_resolve_through_a_clock():
    clock = Clock(torch.device("cpu"))
    t = clock.origin
    records = [
        CommRecord("all_gather", "a", 100, 100, start=t + 1, end=t + 3, stalls=[(t + 2, t + 3)]),
        CommRecord("reduce_scatter", "b", 50, 50, start=t + 2, end=t + 5),
        CommRecord("all_gather", "c", 10, 10, start=t + 6),  # not finished: not counted as busy
    ]
    summary = CommSummary.of(records, clock)
    assert summary.busy_s == pytest.approx(4.0)  # the union of 1-3 and 2-5
    assert summary.exposed_s == pytest.approx(1.0)
    assert (summary.nbytes, summary.count) == (160, 3)
    assert records[0].span(clock) == pytest.approx((1.0, 3.0))


def test_exposed_communication_is_a_part_of_communication():
    """Waits that overlap each other (two collectives waited for at once) or outlast the collective
    (the lane's report of its end comes later) count once, and only while a collective is in flight:
    exposed was once larger than comm, and the overlap ratio negative."""
    clock = Clock(torch.device("cpu"))
    t = clock.origin
    records = [
        CommRecord("all_gather", "a", 8, 8, start=t + 1, end=t + 3, stalls=[(t + 2, t + 4)]),
        CommRecord("all_gather", "b", 8, 8, start=t + 1, end=t + 3, stalls=[(t + 2, t + 3)]),
    ]
    summary = CommSummary.of(records, clock)
    assert summary.busy_s == pytest.approx(2.0) and summary.exposed_s == pytest.approx(1.0)


class FakeEvent:
    """A CUDA event's interface, recorded at a known GPU time (milliseconds)."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.ms - self.ms

    def query(self) -> bool:
        return True


def test_cuda_records_are_resolved_as_event_pairs_not_subtracted():
    """On CUDA every stamp is an event: spans and stalls are read through the clock's origin."""
    clock = Clock(torch.device("cpu"))
    clock.cuda, clock.origin = True, FakeEvent(1000.0)
    records = [
        CommRecord("all_gather", "a", 8, 8, start=FakeEvent(1010), end=FakeEvent(1030),
                   stalls=[(FakeEvent(1020), FakeEvent(1030))]),
        CommRecord("reduce_scatter", "b", 8, 8, start=FakeEvent(1025), end=FakeEvent(1040)),
    ]
    summary = CommSummary.of(records, clock)
    assert summary.busy_s == pytest.approx(0.030)  # 10-40 ms after the origin
    assert summary.exposed_s == pytest.approx(0.010)


def test_a_cuda_model_binds_its_own_device_when_shardwire_creates_the_world(monkeypatch):
    import torch.distributed as dist

    from shardwire import worker

    calls = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(current=device))
    device = torch.device("cuda", 3)
    worker.ensure_initialized(device, TIMEOUT)
    assert calls["backend"] == "nccl" and calls["device_id"] == device and calls["current"] == device
    assert calls["timeout"] == TIMEOUT


@pytest.mark.slow
def test_the_bare_link_benchmark_places_its_two_ranks_on_two_nodes(monkeypatch):
    """benchmarks/link_allreduce.py starts each node's side itself (``testbed exec``, no torchrun, so
    no ``LOCAL_WORLD_SIZE``), from which the transport would take both ranks for one node's: each
    side says it is its node's one rank. Its two sides here, on this machine's loopback."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "link_allreduce.py"
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sides = [subprocess.Popen([sys.executable, str(script), "--rank", str(rank), "--way", "shardwire",
                               "--master", "127.0.0.1", "--repeats", "1"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    done = [side.communicate(timeout=300) for side in sides]
    assert [side.returncode for side in sides] == [0, 0], [err[-2000:] for _, err in done]
    lines = [json.loads(line) for out, _ in done for line in out.splitlines()]
    assert len(lines) == 4 and {line["nodes"] for line in lines} == {2}
