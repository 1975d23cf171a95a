"""Where a sharded parameter's elements lie across the ranks of its shard group, and which boxes of it
this rank reads and writes in a resharding checkpoint (DCP).

Two kinds of value follow a parameter's extent. Per-element values (the parameter itself, Adam's
moments) hold, on each rank, the run of the parameter's flattened elements that rank's slice of the
flat buffer covers: their boxes are that run's (``shardwire.engine.boxes``). Per-parameter scalars
(Adam's step count) are one 0-dim value that every rank holding part of the parameter keeps alike.

Every rank reads what it holds: its own boxes, and every scalar (a rank that holds nothing of a
parameter keeps its scalars too, so all ranks' state has the same entries). Each box is written
once: a per-element box by the rank holding it, a scalar by the parameter's first holder, and under
``hybrid``, where groups hold the same shards, only by the first group (``Layout.writes_shards``).
A parameter with no elements is written as one empty box by its first holder, so the checkpoint
still names it.
"""

from __future__ import annotations

import dataclasses

import torch

from shardwire.engine.boxes import Box, boxes
from shardwire.engine.packing import Packing, ParamSlot

_SCALAR = Box(torch.Size(()), torch.Size(()), 0, 1)


@dataclasses.dataclass(frozen=True, eq=False)
class PartExtent:
    """``slot`` of ``packing`` as this ``rank`` of the shard group sees it; ``writes``: whether this
    rank's group writes its shards."""

    packing: Packing
    slot: ParamSlot
    rank: int
    writes: bool

    @property
    def name(self) -> str:
        return self.slot.names[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.slot.shape)

    def held_by(self, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` of the parameter's flattened elements that ``rank`` holds (consecutive
        ranks, consecutive runs; start == end where it holds none)."""
        lo, hi = self.packing.held(self.slot, rank)
        return lo - self.slot.offset, hi - self.slot.offset

    @property
    def held(self) -> tuple[int, int]:
        return self.held_by(self.rank)

    @property
    def first_holder(self) -> int:
        """The rank holding the parameter's first element (rank 0 for a parameter with no elements)."""
        return self.slot.offset // self.packing.shard_numel if self.slot.numel else 0

    def same_cut(self, other: PartExtent) -> bool:
        """Whether ``other`` cuts the same parameter into the same runs, and this rank holds the same."""
        mine, theirs = self.packing, other.packing
        return (self.slot, self.rank, mine.world_size, mine.shard_numel) == (
            other.slot, other.rank, theirs.world_size, theirs.shard_numel)

    def read_boxes(self, scalar: bool) -> list[Box]:
        return [_SCALAR] if scalar else boxes(self.slot.shape, *self.held)

    def write_boxes(self, scalar: bool) -> list[Box]:
        if not self.writes:
            return []
        if scalar or not self.slot.numel:
            empty = Box(torch.Size([0] * len(self.shape)), self.shape, 0, 0)
            return ([_SCALAR] if scalar else [empty]) if self.rank == self.first_holder else []
        return self.read_boxes(scalar)
