import pytest
import torch

from shardwire.engine.packing import Packing


def make_packing(world):
    return Packing.pack([(("a",), (2, 3)), (("b", "b_tied"), (5,))], torch.float32, world)


@pytest.mark.parametrize("world, shard, padded", [(1, 11, 11), (2, 6, 12), (3, 4, 12), (4, 3, 12)])
def test_padding_makes_equal_shards(world, shard, padded):
    packing = make_packing(world)
    assert (packing.numel, packing.shard_numel, packing.padded_numel) == (11, shard, padded)
    assert [packing.shard_range(r) for r in range(world)] == [(r * shard, (r + 1) * shard) for r in range(world)]


def test_flatten_then_views_round_trip_and_alias_the_buffer():
    packing = make_packing(3)
    a, b = torch.randn(2, 3), torch.randn(5)
    flat = packing.flatten([a, b])
    assert flat[11:].eq(0).all()  # padding is zero
    va, vb = packing.views(flat)
    assert torch.equal(va, a) and torch.equal(vb, b)
    assert va.data_ptr() == flat.data_ptr() and vb.data_ptr() == flat.data_ptr() + 6 * 4


def test_views_of_a_leaf_give_one_flat_gradient_with_zero_padding():
    packing = make_packing(4)
    leaf = packing.flatten([torch.ones(2, 3), torch.ones(5)]).requires_grad_()
    va, vb = packing.views(leaf)
    (va.sum() * 2 + vb.sum() * 3).backward()
    assert leaf.grad.tolist() == [2.0] * 6 + [3.0] * 5 + [0.0]


def test_resharding_keeps_slots_and_changes_padding():
    packing = make_packing(4).resharded(3)
    assert packing.world_size == 3 and packing.slots == make_packing(4).slots and packing.padded_numel == 12
