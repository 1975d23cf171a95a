"""How a unit's parameters lie in its buffer, and which part of each parameter each rank holds.

Each parameter is split by rows (its first dimension) over the ``world_size`` ranks, as FSDP2 and
DTensor's ``Shard(0)`` split it: ``ceil(rows / world_size)`` rows a rank, the last ranks fewer or
none. A 0-dim parameter has no rows and is held whole by every rank (DTensor's ``Replicate()``). A
rank's shard is its rows of every parameter, each padded to the full ``ceil(rows / world_size)``,
laid end to end: the same size on every rank, so one all-gather of equal shards rebuilds the whole
buffer rank by rank (rank-major), and one reduce-scatter of a gradient laid out the same way leaves
each rank the gradient of exactly its shard.

Computation needs each parameter whole and contiguous. So the gathered buffer is copied out, as
FSDP2 copies it out (``split_with_sizes_copy``), into a parameter-major buffer of the same size that
the module's parameters view (``copy_out``, ``views``), and the views' gradients are copied in rank
by rank for the reduce-scatter (``as_gathered``). Where the two orders are one (a single rank, or a
single parameter), neither copy is made.

Checkpoints written before format 6 used the flat packing (``by_rows=False``): the parameters laid
end to end and the whole cut into equal runs of elements, so that a rank held the end of one
parameter and the start of the next. A reader takes their elements through the same ``holders``;
the engine packs by rows. A packing is pure metadata, so checkpoints store it and re-slice a buffer
for another world size.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the buffer: ``offset`` is where its part starts in every rank's shard
    (by rows), or where it starts in the parameters laid end to end (flat). A tied parameter is stored
    once and has several names."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def replicated(self) -> bool:
        """A 0-dim parameter: every rank holds it whole."""
        return not self.shape


@dataclasses.dataclass(frozen=True)
class Held:
    """A rank's part of a parameter: the ``[start, end)`` of the parameter's flattened elements it
    holds (a run of whole rows, by rows), and where that run starts in the rank's shard (``at``)."""

    start: int
    end: int
    at: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Packing:
    slots: tuple[ParamSlot, ...]
    dtype: torch.dtype
    world_size: int
    by_rows: bool = True

    @classmethod
    def pack(cls, named_shapes: list[tuple[tuple[str, ...], tuple[int, ...]]], dtype, world_size) -> Packing:
        """Lay the parameters out by rows, in the given order."""
        slots, offset = [], 0
        for names, shape in named_shapes:
            slot = ParamSlot(tuple(names), tuple(shape), offset)
            slots.append(slot)
            offset += _rows_per_rank(slot, world_size) * slot.row_numel
        return cls(tuple(slots), dtype, world_size)

    @classmethod
    def end_to_end(cls, named_shapes: list[tuple[tuple[str, ...], tuple[int, ...]]], dtype, world_size) -> Packing:
        """The flat packing of checkpoints before format 6, which a manifest of one is checked against."""
        slots, offset = [], 0
        for names, shape in named_shapes:
            slots.append(ParamSlot(tuple(names), tuple(shape), offset))
            offset += math.prod(shape)
        return cls(tuple(slots), dtype, world_size, by_rows=False)

    @property
    def numel(self) -> int:
        """Elements holding parameters (without padding, each counted once)."""
        return sum(slot.numel for slot in self.slots)

    @property
    def shard_numel(self) -> int:
        if not self.by_rows:
            return -(-self.numel // self.world_size)
        return sum(self.part_numel(slot) for slot in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` of the gathered (rank-major) buffer that is ``rank``'s shard."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def part_numel(self, slot: ParamSlot) -> int:
        """The elements a slot takes in every rank's shard, padding included (by rows)."""
        return _rows_per_rank(slot, self.world_size) * slot.row_numel

    def held(self, slot: ParamSlot, rank: int) -> Held:
        """What ``rank`` holds of ``slot``: an empty run (start == end) where it holds nothing.
        Consecutive ranks hold consecutive runs, so a parameter is its ranks' runs concatenated."""
        if not self.by_rows:
            start, end = self.shard_range(rank)
            lo = min(max(start, slot.offset), end)
            hi = max(min(end, slot.offset + slot.numel), lo)
            first = min(max(lo - slot.offset, 0), slot.numel)  # an empty run at the parameter's bounds
            return Held(first, first + hi - lo, lo - start)
        if slot.replicated:
            return Held(0, 1, slot.offset)
        first, last = self._rows_held(slot, rank)
        return Held(first * slot.row_numel, last * slot.row_numel, slot.offset)

    def holders(self, slot: ParamSlot) -> list[tuple[int, Held]]:
        """The ranks that hold elements of ``slot``, each element once (a replicated one: rank 0's)."""
        ranks = [0] if self.by_rows and slot.replicated else range(self.world_size)
        return [(rank, held) for rank in ranks if (held := self.held(slot, rank)).numel]

    def first_holder(self, slot: ParamSlot) -> int:
        """The rank holding the parameter's first element (rank 0 for a parameter with no elements)."""
        holders = self.holders(slot)
        return holders[0][0] if holders else 0

    def local_shape(self, slot: ParamSlot, rank: int) -> torch.Size:
        """The shape of ``rank``'s part of the parameter: its rows (by rows)."""
        if slot.replicated:
            return torch.Size(())
        first, last = self._rows_held(slot, rank)
        return torch.Size((last - first, *slot.shape[1:]))

    def _rows_held(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        per_rank = _rows_per_rank(slot, self.world_size)
        return min(rank * per_rank, slot.rows), min((rank + 1) * per_rank, slot.rows)

    @property
    def ordered_alike(self) -> bool:
        """Whether the gathered buffer is already parameter-major: no copy is needed either way."""
        return not self.by_rows or self.world_size == 1 or len(self.slots) <= 1

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The gathered (rank-major) buffer of ``tensors`` (in slot order), zeros in the padding."""
        out = torch.empty(self.padded_numel, dtype=self.dtype, device=tensors[0].device)
        return self.as_gathered(tuple(tensors), out)

    def views(self, by_param: torch.Tensor) -> list[torch.Tensor]:
        """Views of the parameter-major buffer shaped as the parameters, in slot order."""
        views = []
        for slot, region in zip(self.slots, self._regions(by_param)):
            views.append(region[0] if slot.replicated else region[: slot.numel].view(slot.shape))
        return views

    def copy_out(self, gathered: torch.Tensor, by_param: torch.Tensor) -> None:
        """Copy the gathered (rank-major) buffer into the parameter-major one."""
        if self.ordered_alike:
            if by_param.data_ptr() != gathered.data_ptr():
                by_param.copy_(gathered)
            return
        world = self.world_size
        torch.split_with_sizes_copy(gathered.view(world, -1), [self.part_numel(slot) for slot in self.slots], dim=1,
                                    out=[region.view(world, -1) for region in self._regions(by_param)])

    def shard_of(self, tensors: list[torch.Tensor], rank: int) -> torch.Tensor:
        """``rank``'s shard of ``tensors`` (in slot order, shaped as the parameters): its rows of each,
        zeros in the padding, without laying out the whole buffer."""
        shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=tensors[0].device)
        for slot, tensor in zip(self.slots, tensors):
            held = self.held(slot, rank)
            shard[held.at : held.at + held.numel] = tensor.reshape(-1)[held.start : held.end]
        return shard

    def as_gathered(self, tensors: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        """``tensors`` shaped as the parameters (in slot order: their values, or their gradients for a
        reduce-scatter) laid out as the gathered buffer is, rank by rank, into ``out`` (any floating
        dtype: the copy casts), zeros in the padding: one copy, as FSDP2 makes it (``_chunk_cat``). A
        replicated parameter goes to every rank's shard, so that each rank's sum holds its gradient."""
        world = self.world_size
        rows = [tensor.reshape(1).expand(world) if slot.replicated else tensor
                for slot, tensor in zip(self.slots, tensors) if tensor.numel()]
        if rows:
            torch._chunk_cat(rows, dim=0, num_chunks=world, out=out.view(world, -1))
        else:
            out.zero_()
        return out

    def ranks_part(self, by_param: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """What ranks ``[first, last)`` hold of the gathered buffer, in its order, from the
        parameter-major buffer (a new tensor)."""
        world = self.world_size
        if self.ordered_alike:
            return by_param.view(world, -1)[first:last].reshape(-1).clone()
        return torch.cat([region.view(world, -1)[first:last] for region in self._regions(by_param)], dim=1).view(-1)

    def _regions(self, by_param: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's region of the parameter-major buffer: its padded rows from every rank, in order."""
        sizes = [self.part_numel(slot) * self.world_size for slot in self.slots]
        return list(by_param.split([*sizes, by_param.numel() - sum(sizes)]))[: len(self.slots)]

    def resharded(self, world_size: int) -> Packing:
        """The same parameters laid out for another world size."""
        return Packing.pack([(slot.names, slot.shape) for slot in self.slots], self.dtype, world_size)


def _rows_per_rank(slot: ParamSlot, world_size: int) -> int:
    return 1 if slot.replicated else -(-slot.rows // world_size)
