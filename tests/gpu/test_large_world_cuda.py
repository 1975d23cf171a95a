"""One rank of a world of 8 and of 64 ranks on one GPU, on torch's fake process group: the checks of
``test_large_world`` on CUDA, where the collectives take NCCL's path (torch's collectives on the side
streams, ``Levels``' reduce-scatter within the node and all-to-all across nodes for quantized
reductions, the order check's copy to pinned memory read by event), which a machine of one GPU runs
with more than one rank no other way; and what only a GPU shows: no host synchronization after the
first step, and each rank's peak memory, collectives in flight included, against the memory model's.
"""

from __future__ import annotations

import pytest
import torch

from fake_world import CASES, LAYOUTS, STEPS, WIRES, Training, check_host_work_does_not_grow, \
    check_memory_against_model, check_rank_dependent_paths, fake_world

pytestmark = pytest.mark.gpu

GPU = torch.device("cuda", 0)
# every step from the second sends one of two fragments and applies the one sent a step before
DILOCO = "sync_every=2,fragments=2,wire=int4,fragment_sync_delay=1"


@pytest.fixture(scope="module", autouse=True)
def on_gpu():
    torch.cuda.set_device(GPU)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world, per_node, rank", CASES)
def test_every_path_of_a_rank_of_a_large_world_runs(world, per_node, rank, layout, wire):
    check_rank_dependent_paths(GPU, world, per_node, rank, layout, wire)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world, per_node, rank", CASES)
def test_steps_after_the_first_never_synchronize_the_host(world, per_node, rank, layout, wire):
    """The order check of every communicator (a world of one has none), the quantized reductions'
    kernels and collectives, hybrid's all-reduce ordered after its reduce-scatter by an event: all
    queued without the host waiting for the GPU."""
    with fake_world(world, per_node, rank):
        training = Training.start(GPU, layout, wire)
        training.step()  # records the order, checking agreement on the host
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(STEPS):
                training.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("world, per_node, rank", CASES)
def test_a_sync_every_h_steps_never_synchronizes_the_host(world, per_node, rank):
    """DiLoCo, syncing every H steps across groups, in fragments and quantized: each step from the
    second issues one fragment's all-reduce on the spanning communicator's stream and applies the one
    before, ordered by events, all queued without the host waiting for the GPU."""
    with fake_world(world, per_node, rank):
        training = Training.start(GPU, "hybrid", WIRES[-1], diloco=DILOCO)
        training.step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2 * STEPS):
                training.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outer = training.engine.outer
        assert (outer.steps, outer.checked) == (1 + 2 * STEPS, 2 * STEPS)  # each forward issued the syncs due
        assert outer.in_flight is not None


@pytest.mark.parametrize("last", [False, True], ids=["first rank", "last rank"])
@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_takes_no_more_host_work_at_64_ranks_than_at_8(layout, wire, last):
    check_host_work_does_not_grow(GPU, layout, wire, last=last)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world, per_node, rank", CASES)
def test_a_rank_holds_what_the_memory_model_says(world, per_node, rank, layout, wire):
    check_memory_against_model(GPU, world, per_node, rank, layout, wire)
