"""What a collective costs: phases of fixed latency followed by bytes through the network's levels.

A collective over a group of ``n = N x g`` GPUs (``N`` nodes, ``g`` GPUs of each) moves a buffer of
``S`` bytes (the whole gathered or scattered buffer, as nccl-tests counts it). Its bytes cross two
shared resources: each GPU's intra-node links (capacity: ``intra_node.busbw``) and each node's NICs
(capacity: ``inter_node.busbw``, shared by all GPUs of the node). Every GPU of a node runs the same
collective at the same time, so the node's NIC carries the sum of their inter-node traffic.

Bytes and latency of an all-gather or reduce-scatter, by algorithm (``a``: latency per step):

    ============  =======================  ====================  =============================
    algorithm     through one node's NICs  through one GPU's     latency
                                           intra-node links
    ============  =======================  ====================  =============================
    ring          S (n-1)/n                S (n-1)/n             (n-1) a_inter (a_intra if N=1)
    hierarchical  S (N-1)/N                S (g-1)/g             (N-1) a_inter + (g-1) a_intra
    ============  =======================  ====================  =============================

* ``ring``: NCCL's algorithm for both collectives, one flat ring through every GPU, moving its
  bytes through both levels at once. Each step of the ring waits for its slowest hop, so every one
  of its n - 1 steps pays the inter-node latency; a NIC carries (n-1)/n of the buffer: up to twice
  the hierarchical bytes at two nodes, about the same at many.
* ``hierarchical``: across nodes first among the GPUs of equal local rank, then within each node
  (reduce-scatter runs the same phases in the other order), which is how shardwire builds both
  collectives on gloo. Each node receives exactly the data it lacks, (N-1)/N of the buffer: the
  least any algorithm can move through the NICs.

An all-reduce is a reduce-scatter followed by an all-gather (2 (n-1)/n of the buffer in total,
nccl-tests' factor); an all-reduce of a scalar costs the latency of a tree instead. Several
independent groups may run side by side on a node (hybrid sharding all-reduces each GPU's shard
with its peers of equal local rank on the other nodes): their NIC traffic adds up.
"""

from __future__ import annotations

import dataclasses
import math

from shardwire.sim.specs import ClusterSpec

INTRA, INTER = "intra", "inter"


@dataclasses.dataclass(frozen=True)
class Phase:
    """A fixed latency, then ``flows`` (level -> bytes) moving concurrently."""

    latency_s: float
    flows: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """The GPUs a collective runs over: ``nodes`` x ``gpus`` of each, ``copies`` such groups on every
    node at once."""

    nodes: int
    gpus: int
    copies: int = 1

    @property
    def size(self) -> int:
        return self.nodes * self.gpus


def all_gather(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    return _exchange(nbytes, group, cluster, inter_first=True)


def reduce_scatter(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    return _exchange(nbytes, group, cluster, inter_first=False)


def all_reduce(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    return reduce_scatter(nbytes, group, cluster) + all_gather(nbytes, group, cluster)


def scalar_all_reduce(group: Group, cluster: ClusterSpec) -> list[Phase]:
    """An all-reduce of a few bytes (the gradient norm): libraries pick a tree or recursive
    doubling for it, which waits for log2 of the peers, up and down, on each level."""
    steps_inter = math.ceil(math.log2(group.nodes))
    steps_intra = math.ceil(math.log2(group.gpus))
    latency = 2 * (steps_inter * cluster.inter_node.latency_us + steps_intra * cluster.intra_node.latency_us)
    return [Phase(latency * 1e-6, ())] if group.size > 1 else []


def _exchange(nbytes: float, group: Group, cluster: ClusterSpec, *, inter_first: bool) -> list[Phase]:
    """The phases of an all-gather (``inter_first``) or reduce-scatter of ``nbytes``."""
    N, g, n = group.nodes, group.gpus, group.size
    if n == 1:
        return []
    a_intra = cluster.intra_node.latency_us * 1e-6
    a_inter = cluster.inter_node.latency_us * 1e-6
    if cluster.algorithm == "ring":
        flows = []
        if N > 1:
            flows.append((INTER, group.copies * nbytes * (n - 1) / n))
        if g > 1:
            flows.append((INTRA, nbytes * (n - 1) / n))
        return [Phase((n - 1) * (a_inter if N > 1 else a_intra), tuple(flows))]
    phases = []
    if N > 1:
        phases.append(Phase((N - 1) * a_inter, ((INTER, group.copies * nbytes * (N - 1) / N),)))
    if g > 1:
        phases.append(Phase((g - 1) * a_intra, ((INTRA, nbytes * (g - 1) / g),)))
    return phases if inter_first else phases[::-1]


def capacities_Bps(cluster: ClusterSpec) -> dict[str, float]:
    """Bytes per second each shared resource moves: one GPU's intra-node links, one node's NICs."""
    return {INTRA: cluster.intra_node.busbw_GBps * 1e9, INTER: cluster.inter_node.busbw_GBps * 1e9}


def isolated_s(phases: list[Phase], cluster: ClusterSpec) -> float:
    """Seconds a collective takes with the network to itself."""
    capacity = capacities_Bps(cluster)
    return sum(p.latency_s + max((b / capacity[level] for level, b in p.flows), default=0.0) for p in phases)
