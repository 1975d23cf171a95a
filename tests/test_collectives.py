"""shardwire's collectives compute exactly what torch's do, on every placement of ranks on nodes."""

from __future__ import annotations

import datetime

import pytest
import torch

from harness import run_workers
from shardwire.comm import collectives
from shardwire.comm.topology import Topology

TIMEOUT = datetime.timedelta(seconds=60)


def test_topology_places_ranks_node_by_node():
    topo = Topology(world=6, ranks_per_node=3)
    assert topo.nodes == 2
    assert [topo.place(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert topo.rank(1, 2) == 5


def exact_collectives(rank, world, dtype_name):
    import torch.distributed as dist

    from shardwire.comm.topology import topology

    dtype = getattr(torch, dtype_name)
    size = 5  # elements per shard: odd, so slots do not line up with anything by accident
    shards = [torch.arange(size, dtype=dtype) + 100 * r for r in range(world)]
    gathered = [torch.empty(size * world, dtype=dtype) for _ in range(3)]
    # several collectives in flight at once, so their messages must not be confused
    pending = [collectives.all_gather(out, shards[rank] + i, dist.group.WORLD, tag=f"ag{i}", timeout=TIMEOUT)
               for i, out in enumerate(gathered)]
    fulls = [torch.arange(size * world, dtype=dtype) * (rank + 1 + i) for i in range(2)]
    shares = [torch.empty(size, dtype=dtype) for _ in range(2)]
    pending += [collectives.reduce_scatter(share, full, dist.group.WORLD, tag=f"rs{i}", timeout=TIMEOUT)
                for i, (share, full) in enumerate(zip(shares, fulls))]
    for p in pending:
        p.wait()
    for i, out in enumerate(gathered):
        assert torch.equal(out, torch.cat(shards) + i), f"all_gather {i}"
    ranks_sum = world * (world + 1) // 2
    for i, share in enumerate(shares):
        expected = torch.arange(rank * size, (rank + 1) * size, dtype=dtype) * (ranks_sum + world * i)
        assert torch.equal(share, expected), f"reduce_scatter {i}: {share} != {expected}"
    return topology(dist.group.WORLD).ranks_per_node


@pytest.mark.slow
@pytest.mark.parametrize("world, per_node", [(4, 1), (4, 2), (4, 4), (3, 1), (6, 3)])
def test_all_gather_and_reduce_scatter_are_exact_on_any_placement(world, per_node):
    placements = run_workers(world, exact_collectives, "float32", env={"LOCAL_WORLD_SIZE": str(per_node)})
    assert placements == [per_node] * world


@pytest.mark.slow
def test_low_precision_buffers():
    run_workers(4, exact_collectives, "bfloat16", env={"LOCAL_WORLD_SIZE": "2"})
