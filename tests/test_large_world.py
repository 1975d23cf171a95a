"""One rank of a world of 8 and of 64 ranks, in this process, on torch's fake process group: every path
that depends on the rank and the world runs and issues the collectives its layout promises over the
groups it promises, a step at 64 ranks takes no more host work than at 8, and a rank holds what the
memory model says. ``fake_world`` holds the checks; ``gpu/test_large_world_cuda`` runs them on a GPU,
where the collectives take NCCL's path."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from fake_world import CASES, LAYOUTS, WIRES, WORLDS, check_host_work_does_not_grow, check_memory_against_model, \
    check_rank_dependent_paths, fake_world
from shardwire.comm.communicator import Communicator

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
