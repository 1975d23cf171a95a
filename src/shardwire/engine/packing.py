"""Where each parameter lives in a unit's flat buffer, and which slice of the buffer each rank owns.

A unit's parameters are laid end to end in one contiguous buffer and the buffer is padded with zeros
so that it splits into ``world_size`` equal shards: one all-gather of equal shards rebuilds it, and one
reduce-scatter of the flat gradient leaves each rank the gradient of exactly its shard. The packing is
pure metadata, so checkpoints can store it and re-slice a buffer for another world size.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the buffer. A tied parameter is stored once and has several names."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Packing:
    slots: tuple[ParamSlot, ...]
    dtype: torch.dtype
    world_size: int

    @classmethod
    def pack(cls, named_shapes: list[tuple[tuple[str, ...], tuple[int, ...]]], dtype, world_size) -> "Packing":
        """Lay the parameters out in the given order."""
        slots, offset = [], 0
        for names, shape in named_shapes:
            slots.append(ParamSlot(tuple(names), tuple(shape), offset))
            offset += math.prod(shape)
        return cls(tuple(slots), dtype, world_size)

    @property
    def numel(self) -> int:
        """Elements holding parameters (without padding)."""
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The [start, end) of the padded buffer that ``rank`` owns."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def held(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """The [start, end) of the buffer that is both ``slot``'s and ``rank``'s; start == end when
        ``rank``'s shard misses the parameter. Consecutive ranks hold consecutive parts, so a
        parameter flattened is its parts concatenated in rank order."""
        start, end = self.shard_range(rank)
        lo = min(max(start, slot.offset), end)
        return lo, max(min(end, slot.offset + slot.numel), lo)

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One padded flat buffer holding ``tensors`` (in slot order)."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=tensors[0].device)
        for slot, tensor in zip(self.slots, tensors):
            flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped as the parameters, in slot order.

        One ``split`` makes all of them, so when ``flat`` requires grad, autograd gathers the
        gradients of every view into a single flat gradient (zeros where a view had none).
        """
        sizes = [slot.numel for slot in self.slots]
        pieces = flat.split([*sizes, flat.numel() - self.numel])
        return [piece.view(slot.shape) for piece, slot in zip(pieces, self.slots)]

    def resharded(self, world_size: int) -> "Packing":
        """The same parameters laid out for another world size (only the padding changes)."""
        return dataclasses.replace(self, world_size=world_size)
