from dataclasses import astuple

import pytest
import torch

from shardwire.engine.packing import Packing


def make_packing(world):
    """A matrix of two rows, a vector of five (tied: two names) and a 0-dim scalar."""
    return Packing.pack([(("a",), (2, 3)), (("b", "b_tied"), (5,)), (("c",), ())], torch.float32, world)


def values():
    return [torch.arange(6.0).view(2, 3), torch.arange(10.0, 15.0), torch.tensor(-1.0)]


@pytest.mark.parametrize("world, shard", [(1, 12), (2, 7), (3, 6), (4, 6)])
def test_each_rank_holds_its_rows_of_every_parameter_padded_to_equal_shards(world, shard):
    packing = make_packing(world)
    assert (packing.numel, packing.shard_numel, packing.padded_numel) == (12, shard, shard * world)
    for slot, tensor in zip(packing.slots, values()):
        runs = [packing.held(slot, rank) for rank in range(world)]
        if slot.replicated:  # held whole by every rank
            assert all((run.start, run.end) == (0, 1) for run in runs)
            continue
        # as DTensor's Shard(0) and FSDP2 split it: torch.chunk's rows, nothing for the ranks it leaves out
        chunks = list(torch.chunk(tensor, world))
        chunks += [tensor[:0]] * (world - len(chunks))
        assert [packing.local_shape(slot, rank) for rank in range(world)] == [chunk.shape for chunk in chunks]
        assert [run.numel for run in runs] == [chunk.numel() for chunk in chunks]
        assert [run.start for run in runs[1:]] == [run.end for run in runs[:-1]] and runs[-1].end == slot.numel
        assert all(run.at == slot.offset for run in runs)


def test_the_gathered_buffer_is_copied_out_by_parameter_and_viewed_in_their_shapes():
    packing = make_packing(3)
    gathered = packing.flatten(values())
    for rank in range(3):  # every shard holds its rows of each parameter, in slot order
        start, end = packing.shard_range(rank)
        shard = gathered[start:end]
        for slot, tensor in zip(packing.slots, values()):
            run = packing.held(slot, rank)
            assert torch.equal(shard[run.at : run.at + run.numel], tensor.reshape(-1)[run.start : run.end])
    by_param = torch.full_like(gathered, float("nan"))
    packing.copy_out(gathered, by_param)
    views = packing.views(by_param)
    assert all(torch.equal(view, tensor) for view, tensor in zip(views, values()))
    assert all(view.untyped_storage().data_ptr() == by_param.untyped_storage().data_ptr() for view in views)


def test_gradients_are_copied_in_rank_by_rank_for_a_reduce_scatter():
    """Each rank's share of the copied-in gradients is its rows of each parameter's gradient, padding
    zero; a replicated parameter's gradient is in every share, so that each rank's sum holds it."""
    packing = make_packing(2)
    grads = (torch.full((2, 3), 2.0), torch.full((5,), 3.0), torch.tensor(4.0))
    shares = packing.as_gathered(grads, torch.empty(packing.padded_numel, dtype=torch.float64)).view(2, -1)
    assert shares.dtype == torch.float64  # the copy casts to the reduce dtype
    assert shares.tolist() == [[2.0] * 3 + [3.0] * 3 + [4.0], [2.0] * 3 + [3.0] * 2 + [0.0] + [4.0]]


def test_one_rank_or_one_parameter_needs_no_copy():
    assert make_packing(1).ordered_alike and not make_packing(2).ordered_alike
    single = Packing.pack([(("w",), (5, 2))], torch.float32, 3)
    assert single.ordered_alike
    gathered = single.flatten([torch.arange(10.0).view(5, 2)])
    assert torch.equal(single.views(gathered)[0], torch.arange(10.0).view(5, 2))


def test_the_flat_packing_of_old_checkpoints_holds_equal_runs_of_the_parameters_end_to_end():
    """Checkpoints before format 6: a rank's run may end inside one parameter and go on in the next."""
    packing = Packing.end_to_end([(("a",), (2, 3)), (("b",), (5,))], torch.float32, 3)
    assert (packing.shard_numel, packing.padded_numel) == (4, 12)
    a, b = packing.slots
    assert [astuple(packing.held(a, rank)) for rank in range(3)] == [(0, 4, 0), (4, 6, 0), (6, 6, 0)]
    assert [astuple(packing.held(b, rank)) for rank in range(3)] == [(0, 0, 4), (0, 2, 2), (2, 5, 0)]
    assert [rank for rank, _ in packing.holders(b)] == [1, 2]


def test_resharding_keeps_slots_and_lays_them_out_for_the_new_world():
    packing = make_packing(4).resharded(3)
    assert packing == make_packing(3)
    assert [slot.names for slot in packing.slots] == [slot.names for slot in make_packing(4).slots]
