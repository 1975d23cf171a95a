"""Where ranks sit on nodes: a group's own placement, which falls back to one node, and the launch's,
which refuses a count of ranks per node that does not divide the world."""

import pytest

from shardwire.placement import Placement, placement


def test_ranks_are_placed_node_by_node():
    placed = Placement(world=6, ranks_per_node=3)
    assert placed.nodes == 2
    assert [placed.place(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert placed.rank(1, 2) == 5
    assert placed.node_members() == [[0, 1, 2], [3, 4, 5]]
    assert placed.cross_node_members() == [0, 3]


def test_a_subgroup_is_placed_by_its_ranks():
    assert placement([0, 1, 2, 3], 2) == Placement(4, 2)
    assert placement([1, 3], 2) == Placement(2, 1)  # a hybrid layout's replicas: one rank per node
    assert placement([2, 3], 2) == Placement(2, 2)  # a shard group: one node
    assert placement([0, 1, 4, 5], 2) == Placement(4, 2)  # groups spanning whole nodes
    assert placement([0, 2, 1, 3], 2) == Placement(4, 4)  # interleaved nodes: treated as one node
    assert placement([0, 1, 2], 2) == Placement(3, 3)  # uneven: treated as one node


def test_the_launch_is_placed_by_the_count_given_else_torchrun_else_one_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert Placement.launched(4) == Placement(4, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Placement.launched(4) == Placement(4, 2)
    assert Placement.launched(4, 1) == Placement(4, 1)


@pytest.mark.parametrize("ranks_per_node", [3, 0])
def test_the_launch_refuses_nodes_that_do_not_divide_the_world(ranks_per_node):
    with pytest.raises(ValueError, match=f"4 ranks do not split into nodes of {ranks_per_node} ranks each"):
        Placement.launched(4, ranks_per_node)
