"""A group's two levels, its nodes and each position across them, for reductions that treat the
bytes within a node and between nodes differently where torch's collectives carry them (NCCL).

A quantized reduce-scatter (``shardwire.comm.wire``) keeps bytes within a node exact and
quantizes those that cross nodes. With torch's collectives that is two of them: a reduce-scatter
within the node, in full precision, leaves each rank the node's partial sums of the slots owned by
the ranks of its position on every node; an all-to-all between those ranks, one per node, carries
each partial sum, quantized, to its owner, which decodes and adds them up in fp32 (ZeRO++'s qgZ
does the same with all-to-alls in both steps). The point-to-point transport on gloo runs the same
two steps itself (``Exchange.reduce_scatter``).
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from shardwire.comm import groups
from shardwire.comm.quantize import decode, encode
from shardwire.comm.wire import Codec
from shardwire.placement import Placement

_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class Levels:
    """``within``: the ranks of this rank's node (None where a node holds one rank); ``across``: the
    ranks of this rank's position on every node, in node order."""

    placement: Placement
    within: dist.ProcessGroup | None
    across: dist.ProcessGroup

    @classmethod
    def of(cls, group: dist.ProcessGroup, placement: Placement, device: torch.device,
           timeout: datetime.timedelta) -> "Levels":
        """Every rank of ``group`` makes its levels together, in the same order."""
        per_node = placement.ranks_per_node
        if per_node == 1:
            return cls(placement, None, group)
        return cls(placement,
                   groups.blocks(group, per_node, device, timeout),
                   groups.columns(group, per_node, device, timeout))

    def reduce_scatter(self, codec: Codec, output: torch.Tensor, full: torch.Tensor, *, average: bool,
                       residual: torch.Tensor | None) -> None:
        """Sum ``full`` over the group into this rank's slot ``output``, quantizing across nodes only
        (``residual``: error feedback, one fp32 row per other node, in node order). Synchronous:
        on CUDA, ordered on the current stream."""
        placement, size = self.placement, output.numel()
        node = dist.get_rank(self.across)
        by_position = full.view(placement.nodes, placement.ranks_per_node, size).transpose(0, 1)
        if self.within is None:
            partial = by_position[0]
        else:
            partial = torch.empty(placement.nodes, size, dtype=full.dtype, device=full.device)
            _torch_reduce_scatter(partial.view(-1), by_position.contiguous().view(-1), group=self.within)
        # the other nodes' rows, by slicing: a list index would copy the list to the GPU and wait for it
        outgoing = encode(codec, torch.cat((partial[:node], partial[node + 1:])), residual)
        incoming = torch.empty_like(outgoing)
        row = outgoing.shape[1]
        splits = [0 if n == node else row for n in range(placement.nodes)]
        dist.all_to_all_single(incoming.view(-1), outgoing.view(-1), splits, splits, group=self.across)
        total = decode(codec, incoming, size).sum(dim=0).add_(partial[node])
        output.copy_(total.div_(placement.world) if average else total)
