"""Where ranks sit on nodes: a group's own placement, which falls back to one node, and the launch's,
which refuses a count of ranks per node that does not divide the world; the launch's ranks per node,
from torchrun's variable or a SLURM job step's."""

import re

import pytest

from shardwire.placement import Placement, launch_ranks_per_node, placement

# A task of `srun --nodes 2 --ntasks-per-node 4 python train.py`, as srun sets its environment.
SLURM_STEP = {"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_TASKS_PER_NODE": "4(x2)"}


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


def test_the_launch_s_ranks_per_node_are_torchrun_s_else_one_node():
    assert launch_ranks_per_node(8, environ={"LOCAL_WORLD_SIZE": "4"}) == 4
    assert launch_ranks_per_node(8, environ={}) == 8


@pytest.mark.parametrize("variables, per_node", [
    ({}, 4),
    ({"SLURM_STEP_TASKS_PER_NODE": "8"}, 8),  # one node
    ({"SLURM_STEP_TASKS_PER_NODE": "4,4"}, 4),
    ({"SLURM_DISTRIBUTION": "block:cyclic"}, 4),  # node by node; cores within a node do not matter
    # the step's own counts, not the job's (srun --preserve-env keeps SLURM_NTASKS the job's)
    ({"SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)"}, 4),
])
def test_a_slurm_step_that_is_this_world_places_its_tasks_per_node(variables, per_node):
    assert launch_ranks_per_node(8, {**SLURM_STEP, **variables}) == per_node


@pytest.mark.parametrize("per_node, world", [("2(x3),1", 7), ("2,1,1", 4), ("2(x2),3", 7), ("2(x3)", 8), ("0", 4)])
def test_a_slurm_step_placed_unevenly_is_one_node_to_the_engine_and_refused_by_the_launch(
        per_node, world, monkeypatch):
    environ = {"SLURM_STEP_NUM_TASKS": str(world), "SLURM_PROCID": "0", "SLURM_STEP_TASKS_PER_NODE": per_node}
    assert launch_ranks_per_node(world, environ) == world
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=fr"SLURM's job step does not place its {world} ranks evenly on nodes, "
                                         fr"node by node \(SLURM_STEP_TASKS_PER_NODE={re.escape(per_node)}\)"):
        Placement.launched(world)


def test_a_slurm_step_distributed_cyclically_is_not_node_by_node():
    assert launch_ranks_per_node(8, {**SLURM_STEP, "SLURM_DISTRIBUTION": "cyclic"}) == 8


@pytest.mark.parametrize("environ", [
    # torchrun's workers, one torchrun per node: the step's tasks are the torchruns
    {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"},
    # a batch script, in no step, that starts the ranks itself (every one with its SLURM_PROCID,
    # 0): the job's variables say what srun would start, whatever their counts
    {"SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "0"},
    {**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "eight"},
])
def test_a_slurm_step_that_is_not_this_world_is_ignored(environ):
    assert launch_ranks_per_node(8, environ) == 8
    assert launch_ranks_per_node(8, {**environ, "LOCAL_WORLD_SIZE": "4"}) == 4


def test_every_task_of_a_step_comes_to_the_same_count_whatever_rank_it_is_given():
    """Ranks that disagreed would form different groups and wait for each other: a task's own
    SLURM_PROCID (or a RANK the script chose otherwise) changes nothing."""
    counts = {launch_ranks_per_node(8, {**SLURM_STEP, "SLURM_PROCID": str(procid), "RANK": str(rank)})
              for procid in range(8) for rank in range(8)}
    assert counts == {4}


def test_torchrun_s_variable_wins_over_a_slurm_step():
    """torchrun inside an sbatch allocation: torchrun's node is what its workers share, whatever the
    step around it says, even a step whose task count happens to be the world's."""
    assert launch_ranks_per_node(8, {**SLURM_STEP, "LOCAL_WORLD_SIZE": "2"}) == 2
    assert launch_ranks_per_node(16, {**SLURM_STEP, "LOCAL_WORLD_SIZE": "8"}) == 8


def test_the_launch_is_placed_by_a_slurm_step(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name, value in SLURM_STEP.items():
        monkeypatch.setenv(name, value)
    assert Placement.launched(8) == Placement(8, 4)
    assert Placement.launched(8, 2) == Placement(8, 2)
