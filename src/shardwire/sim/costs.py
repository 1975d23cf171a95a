"""What collectives cost, priced rather than run (running them is ``shardwire.comm``'s): phases of
fixed time (latencies, quantization kernels) followed by bytes through the network's levels.

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

Quantized collectives (``shardwire.comm.wire``: a ``Codec`` of B elements per fp32 scale, ``w`` =
``packed_numel(k) / k`` bytes per element of a row of k, 1 + 4/B for int8 and 1/2 + 4/B for int4)
run only over groups that span nodes, as the engine's (``shardwire.comm.communicator``); ``P``
elements, ``s = ceil(P/n)`` per GPU:

* all-gather: each GPU encodes its shard and the packed bytes of all shards, ``n packed(s)`` = ``w P``,
  are gathered by the cluster's algorithm, within nodes too; then each GPU decodes all ``n s``.
* reduce-scatter, always in two steps whatever the algorithm (``shardwire.comm.levels``): within
  the node in full precision (the hierarchical intra phase, ``r P (g-1)/g``), then each GPU encodes
  the node's partial sums of the ``N - 1`` slots that other nodes own, sends them (a NIC carries
  ``w P (N-1)/N``), and decodes and adds up the ``N - 1`` slots it receives.
* all-reduce: a quantized reduce-scatter, then a quantized all-gather of its result.

Encoding and decoding are elementwise passes, ``cluster.quantize_gelems`` billion elements a second:
each is a phase of its own on the collective's lane, with no bytes moving (encode before the
transfer it feeds, decode after the one it reads), so the collective takes that much longer and
its lane is busy that much more.

Communication is not free for compute: NCCL runs each collective as kernels that hold some of the
GPU's SMs (and share its memory bandwidth) from start to end, and on CPUs the transport's threads
take cores. Each phase names the level whose collective runs it: the outermost level it moves bytes
through (a ring that crosses nodes is sized for the network, its channels set by the NICs), and for
a phase without bytes, the level of the transfer it serves (a latency, the wire's kernels, which
only run across nodes). While a phase runs, compute proceeds at ``1 - compute_share`` of that
level (``shardwire.sim.specs.LinkSpec``; ``shardwire.sim.events.Processor``).
"""

from __future__ import annotations

import dataclasses
import math

from shardwire.comm.wire import Codec
from shardwire.sim.specs import ClusterSpec, LinkSpec

INTRA, INTER = "intra", "inter"


@dataclasses.dataclass(frozen=True)
class Phase:
    """A fixed time (a latency, or a quantization kernel), then ``flows`` (level -> bytes) moving
    concurrently; ``level`` is the network level whose collective runs it, and whose
    ``compute_share`` of the GPU it takes meanwhile."""

    latency_s: float
    flows: tuple[tuple[str, float], ...]
    level: str
    compute_share: float | None = None  # what it holds of the compute, where not its level's (its all_gather_share)


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


def all_gather_phases(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    """The phases of an all-gather of ``nbytes``, each holding its level's ``all_gather_share`` of
    the compute where the level gives one (a library whose all-gathers hold fewer SMs)."""
    return [p if (share := level_spec(cluster, p.level).all_gather_share) is None
            else dataclasses.replace(p, compute_share=share)
            for p in _exchange(nbytes, group, cluster, inter_first=True)]


def reduce_scatter_phases(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    return _exchange(nbytes, group, cluster, inter_first=False)


def all_reduce_phases(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    return reduce_scatter_phases(nbytes, group, cluster) + all_gather_phases(nbytes, group, cluster)


def crossing_nodes(codec: Codec | None, group: Group) -> Codec | None:
    """The codec of a collective over ``group``: none within a node, where bytes stay exact."""
    return codec if group.nodes > 1 else None


def quantized_all_gather_phases(numel: float, group: Group, cluster: ClusterSpec, codec: Codec) -> list[Phase]:
    """Gather ``numel`` elements as packed bytes: encode this GPU's shard, gather every shard's
    bytes, decode them all."""
    shard = math.ceil(numel / group.size)
    packed = group.size * codec.packed_numel(shard)
    return [*_kernels(shard, cluster), *all_gather_phases(packed, group, cluster),
            *_kernels(group.size * shard, cluster)]


def quantized_reduce_scatter_phases(numel: float, element_bytes: int, group: Group, cluster: ClusterSpec,
                                    codec: Codec) -> list[Phase]:
    """Reduce-scatter ``numel`` elements of ``element_bytes``: exact within the node, then the
    partial sums of the slots other nodes own, encoded, sent and decoded."""
    slot = math.ceil(numel / group.size)
    crossing = (group.nodes - 1) * slot  # elements each GPU sends to other nodes, and receives
    return [*_within(numel * element_bytes, group, cluster), *_kernels(crossing, cluster),
            *_across(group.size * codec.packed_numel(slot), group, cluster), *_kernels(crossing, cluster)]


def quantized_all_reduce_phases(numel: float, element_bytes: int, group: Group, cluster: ClusterSpec,
                                codec: Codec) -> list[Phase]:
    return (quantized_reduce_scatter_phases(numel, element_bytes, group, cluster, codec)
            + quantized_all_gather_phases(numel, group, cluster, codec))


def scalar_all_reduce_phases(group: Group, cluster: ClusterSpec) -> list[Phase]:
    """An all-reduce of a few bytes (the gradient norm): libraries pick a tree or recursive
    doubling for it, which waits for log2 of the peers, up and down, on each level."""
    steps_inter = math.ceil(math.log2(group.nodes))
    steps_intra = math.ceil(math.log2(group.gpus))
    latency = 2 * (steps_inter * cluster.inter_node.latency_us + steps_intra * cluster.intra_node.latency_us)
    return [Phase(latency * 1e-6, (), INTER if group.nodes > 1 else INTRA)] if group.size > 1 else []


def _exchange(nbytes: float, group: Group, cluster: ClusterSpec, *, inter_first: bool) -> list[Phase]:
    """The phases of an all-gather (``inter_first``) or reduce-scatter of ``nbytes``."""
    N, g, n = group.nodes, group.gpus, group.size
    if n == 1:
        return []
    if cluster.algorithm == "ring":
        flows = []
        if N > 1:
            flows.append((INTER, group.copies * nbytes * (n - 1) / n))
        if g > 1:
            flows.append((INTRA, nbytes * (n - 1) / n))
        level = INTER if N > 1 else INTRA
        return [Phase((n - 1) * level_spec(cluster, level).latency_us * 1e-6, tuple(flows), level)]
    if inter_first:
        return _across(nbytes, group, cluster) + _within(nbytes, group, cluster)
    return _within(nbytes, group, cluster) + _across(nbytes, group, cluster)


def _across(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    """The hierarchical phase across nodes of a buffer of ``nbytes``, among GPUs of equal local rank."""
    N = group.nodes
    if N == 1:
        return []
    return [Phase((N - 1) * cluster.inter_node.latency_us * 1e-6, ((INTER, group.copies * nbytes * (N - 1) / N),),
                  INTER)]


def _within(nbytes: float, group: Group, cluster: ClusterSpec) -> list[Phase]:
    """The hierarchical phase within each node of a buffer of ``nbytes``."""
    g = group.gpus
    if g == 1:
        return []
    return [Phase((g - 1) * cluster.intra_node.latency_us * 1e-6, ((INTRA, nbytes * (g - 1) / g),), INTRA)]


def _kernels(elements: float, cluster: ClusterSpec) -> list[Phase]:
    """A pass of the quantization kernels over ``elements`` on one GPU, for a transfer across nodes;
    none where the cluster does not price them."""
    if cluster.quantize_gelems is None:
        return []
    return [Phase(elements / (cluster.quantize_gelems * 1e9), (), INTER)]


def compute_share(cluster: ClusterSpec, phase: Phase) -> float:
    """The share of a GPU's compute ``phase`` holds while it runs."""
    return level_spec(cluster, phase.level).compute_share if phase.compute_share is None else phase.compute_share


def level_spec(cluster: ClusterSpec, level: str) -> LinkSpec:
    return cluster.inter_node if level == INTER else cluster.intra_node


def capacities_Bps(cluster: ClusterSpec) -> dict[str, float]:
    """Bytes per second each shared resource moves: one GPU's intra-node links, one node's NICs."""
    return {INTRA: cluster.intra_node.busbw_GBps * 1e9, INTER: cluster.inter_node.busbw_GBps * 1e9}


def isolated_s(phases: list[Phase], cluster: ClusterSpec) -> float:
    """Seconds a collective takes with the network to itself."""
    capacity = capacities_Bps(cluster)
    return sum(p.latency_s + max((b / capacity[level] for level, b in p.flows), default=0.0) for p in phases)
