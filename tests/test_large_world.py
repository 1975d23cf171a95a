"""One rank of a world of 8 and of 64 ranks, in this process, on torch's fake process group: every path
that depends on the rank and the world runs and issues the collectives its layout promises over the
groups it promises, a step at 64 ranks takes no more host work than at 8, and a rank holds what the
memory model says. ``fake_world`` holds the checks; ``gpu/test_large_world_cuda`` runs them on a GPU,
where the collectives take NCCL's path."""

from __future__ import annotations

import datetime
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fake_world import CASES, LAYOUTS, MEMORY_BATCH, MEMORY_MODEL, STEPS, WIRES, WORLDS, Training, \
    check_host_work_does_not_grow, check_memory_against_model, check_rank_dependent_paths, fake_world, memory_model, \
    peak_nbytes
from shardwire.comm.communicator import Communicator
from shardwire.engine import outer

CPU = torch.device("cpu")


@pytest.mark.parametrize("world, per_node, rank", CASES)
def test_agreement_checks_see_ranks_that_agree_with_this_one(world, per_node, rank):
    """What the engine's agreement checks rest on (``shardwire.comm.communicator``): they compare
    all-gathered values, and a fake all-gather gives every rank's slot this rank's input, so the
    checks see a world of ranks like this one and never read memory nobody wrote."""
    with fake_world(world, per_node, rank):
        comm = Communicator(dist.group.WORLD, CPU, timeout=datetime.timedelta(seconds=60))
        assert comm.all_gather_values([rank, world], tag="values") == [[rank, world]] * world
        comm.all_gather(torch.empty(world, dtype=torch.int64), torch.tensor([rank]), tag="a unit").wait()
        comm.verify_order("the step before")  # every rank issued the same collectives: no error


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world, per_node, rank", CASES)
def test_every_path_of_a_rank_of_a_large_world_runs(world, per_node, rank, layout, wire):
    check_rank_dependent_paths(CPU, world, per_node, rank, layout, wire)


@pytest.mark.parametrize("last", [False, True], ids=["first rank", "last rank"])
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_takes_no_more_host_work_at_64_ranks_than_at_8(layout, wire, last):
    check_host_work_does_not_grow(CPU, layout, wire, last=last)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world, per_node", WORLDS)
def test_a_rank_holds_what_the_memory_model_says(world, per_node, layout):
    """As the last rank, with a quantized wire (every part of the model). On the CPU the peak leaves
    out what a GPU holds for collectives in flight (``fake_world.peak_nbytes``); the CUDA suite
    checks every case on a GPU."""
    check_memory_against_model(CPU, world, per_node, world - 1, layout, WIRES[-1])


@pytest.mark.slow
@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["groups of one job", "fault-tolerant groups"])
def test_a_sync_behind_the_steps_holds_what_the_memory_model_says(fault_tolerant):
    """DiLoCo in 2 fragments, each sync applied a step after it is sent: through every step one
    fragment's sync is in flight, holding its change and the shards its eager step gave and, between
    fault-tolerant groups (whose quorum may drop the sync, and its eager step with it), the shards
    from before that step too. The outer state this rank holds through the step is the memory
    model's, and the rank's peak, that state included, within 5% of the model's total. The engine's
    outer states are built as over a quorum (the only thing that makes them keep that copy) without
    torchft: the fake group's communicator stands for it."""
    world, per_node = WORLDS[0]
    diloco = "sync_every=2,fragments=2,fragment_sync_delay=1,wire=none"
    with fake_world(world, per_node, world - 1):
        with mock.patch.object(outer, "Quorum", Communicator if fault_tolerant else outer.Quorum):
            training = Training.start(CPU, "hybrid", None, config=MEMORY_MODEL, batch=MEMORY_BATCH, diloco=diloco)
        for _ in range(STEPS - 1):
            training.step()
        states = [flat.outer for flat in training.engine.flats]

        def held() -> int:  # the outer states' tensors, each storage once
            tensors = [t for s in states for t in (s.anchor, s.momentum, s.change, s.sent, s.before_eager)
                       if t is not None]
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

        before = held()
        measured = peak_nbytes(training) + before
        in_flight = [s for s in states if s.change is not None]
        assert training.engine.outer.in_flight is not None and 0 < len(in_flight) < len(states)
        assert all((s.before_eager is not None) == fault_tolerant for s in in_flight)
        through_the_step = held()
    estimate = memory_model(world, per_node, "hybrid", None, diloco=diloco, fault_tolerance=fault_tolerant)
    assert abs(through_the_step / estimate.outer_state - 1) <= 0.05, (through_the_step, estimate.outer_state)
    assert abs(before / estimate.outer_state - 1) <= 0.05, (before, estimate.outer_state)
    assert abs(measured / estimate.total - 1) <= 0.05, (measured, estimate)
