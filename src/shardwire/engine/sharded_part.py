"""``ShardedPart``: a rank's part of a sharded parameter (or of its optimizer state) in a state dict, as
torch's distributed checkpointing reads it.

A state dict of a sharded model holds, per parameter, the run of its flattened elements this rank
holds. Torch's checkpointing knows two kinds of distributed values and nothing else: DCP
(``torch.distributed.checkpoint``) asks a value for the boxes of the whole tensor it holds
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, torch's
``_Checkpointable`` protocol) and checks that its ``size()`` is the whole tensor's; and
``torch.distributed.checkpoint.state_dict`` gathers whole tensors (``full_state_dict=True``) from
``DTensor``s only, by redistributing them to ``Replicate()``. A plain tensor would pass for a whole
replicated one, which DCP then saves from a single rank. So each part is a ``DTensor`` subclass
whose shape is the whole parameter's and whose local tensor is the part itself (a view: DCP loads
straight into the parameters and the optimizer's state), which describes its boxes
(``PartExtent``), gathers over shardwire's communicator when asked for the whole tensor, and
refuses every DTensor operation that would treat the part as something it is not.

Its placement is ``Replicate()`` on a mesh of the shard group: DTensor's placements cannot express
a run of flattened elements, and the one place torch distributes a whole tensor into an existing
value's placements (a full optimizer state dict loaded with ``set_state_dict``) then hands each
rank the whole tensor, from which it keeps its part.

Outside torch's checkpointing a part behaves as the rank's part: ``to_local()`` is the flat part;
``torch.save`` stores the flat part (``shardwire.full_state_dict``'s metadata reassembles the
parameter); ``load_state_dict`` takes it back (``local_part``); elementwise arithmetic between parts
of the same parameter stays a part.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, _DTensorSpec, _TensorMeta
from torch.utils import _pytree as pytree

from shardwire.engine.flat_param import FlatParam
from shardwire.engine.layout import Layout
from shardwire.engine.part_extent import PartExtent

# Operations that keep a part a part besides the elementwise ones: they copy, cast, move or alias
# the part and keep its shape.
_PART_PRESERVING = {
    torch.ops.aten.detach.default,
    torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.copy_.default,
}


class ShardedPart(DTensor):
    """This rank's part of a parameter, or of one per-element optimizer state tensor (flat, as the
    model and the optimizer hold it), or of a per-parameter scalar (``scalar``: a 0-dim value that
    the parameter's holders keep alike), named ``what`` in errors."""

    _extent: PartExtent
    _group: ShardGroup
    _scalar: bool
    _what: str

    def __new__(cls, local: torch.Tensor, extent: PartExtent, group: ShardGroup, *, scalar: bool = False,
                what: str | None = None) -> ShardedPart:
        shape = torch.Size(()) if scalar else extent.shape
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        spec = _DTensorSpec(group.mesh, (Replicate(),), tensor_meta=_TensorMeta(shape, strides, local.dtype))
        part = super().__new__(cls, local, spec, requires_grad=False)
        part._extent, part._group, part._scalar = extent, group, scalar
        part._what = what or extent.name
        return part

    def __repr__(self) -> str:
        extent = self._extent
        kind = "scalar" if self._scalar else f"elements {extent.held} of {tuple(extent.shape)}"
        return (f"ShardedPart({self._what!r}, rank {extent.rank} of {extent.packing.world_size}: {kind}, "
                f"local={self._local_tensor})")

    def _like(self, local: torch.Tensor) -> ShardedPart:
        return ShardedPart(local, self._extent, self._group, scalar=self._scalar, what=self._what)

    # ------------------------------------------------------------- DCP's _Checkpointable protocol

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, box.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(box.offsets, box.sizes), properties, self.size()),
            )
            for box in self._extent.write_boxes(self._scalar)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(box.offsets, box.sizes) for box in self._extent.read_boxes(self._scalar)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The box at ``index.offset``, as a view of the part (DCP loads into it in place)."""
        for box in (*self._extent.read_boxes(self._scalar), *self._extent.write_boxes(self._scalar)):
            if box.offsets == index.offset:
                return self._local_tensor.view(-1)[box.start : box.end].view(box.sizes)
        raise ValueError(f"{self._what!r} has no box at {tuple(index.offset or ())} on this rank")

    # ------------------------------------------------------------------------- the whole tensor

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """The whole tensor on every rank of the shard group (``placements`` all ``Replicate()``), the
        one redistribution a part has: what ``full_tensor()`` and torch's full state dicts ask for.
        A collective: every rank of the group must ask for the same values in the same order. It
        completes before returning, and is not differentiable (a state dict's values never are)."""
        if device_mesh not in (None, self.device_mesh) or not placements or not all(
                p.is_replicate() for p in placements):
            raise ValueError(
                f"{self._what!r} is shardwire's part of a tensor, which only gathers whole on its own mesh "
                f"(placements=[Replicate()]), not to {placements} on {device_mesh}"
            )
        whole = self._gather()
        return DTensor.from_local(whole.to(forward_dtype or whole.dtype), self.device_mesh, [Replicate()],
                                  run_check=False)

    def _gather(self) -> torch.Tensor:
        """Every rank's part, padded to the longest, in one all-gather. Ranks whose state dicts differ
        would gather one value with another, of another size: a gather of the value's name and size
        first makes that an error."""
        comm, extent = self._group.comm, self._extent
        ranges = [extent.held_by(rank) for rank in range(extent.packing.world_size)]
        width = 1 if self._scalar else max(end - start for start, end in ranges) or 1
        asked = [zlib.crc32(self._what.encode()), width]
        differing = [rank for rank, theirs in enumerate(comm.all_gather_values(asked, tag="state dict entry"))
                     if theirs != asked]
        if differing:
            raise RuntimeError(
                f"rank {comm.rank} gathers {self._what!r} while ranks {differing} of its shard group gather "
                f"another value: every rank's state dict must hold the same entries in the same order"
            )
        local = self._local_tensor.reshape(-1).to(comm.device)
        mine = local.new_zeros(width)
        mine[: local.numel()] = local
        rows = local.new_empty(len(ranges), width)
        comm.all_gather(rows.view(-1), mine, tag=f"state dict {self._what}").wait()
        if self._scalar:
            return rows[extent.first_holder, 0].clone()
        held = [rows[rank, : end - start] for rank, (start, end) in enumerate(ranges)]
        return torch.cat(held).view(extent.shape)

    # --------------------------------------------------------------- everything else: the part

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, ``all_gather_object``), a part is the plain flat part."""
        return self._local_tensor.__reduce_ex__(protocol)

    def __deepcopy__(self, memo) -> ShardedPart:
        memo[id(self)] = copied = self._like(self._local_tensor.clone())
        return copied

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        parts = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, ShardedPart)]
        first = parts[0]
        alike = all(p._extent.same_cut(first._extent) and p._scalar == first._scalar for p in parts)
        plain = [leaf for leaf in pytree.tree_leaves((args, kwargs))
                 if isinstance(leaf, torch.Tensor) and not isinstance(leaf, ShardedPart) and leaf.dim() > 0]
        if not (func in _PART_PRESERVING or torch.Tag.pointwise in func.tags) or not alike or plain:
            raise RuntimeError(
                f"{func} on {first._what!r}: a sharded model's state-dict value is this rank's part of the "
                f"tensor, which takes elementwise operations with parts of the same tensor only; use "
                f".to_local() for the flat part, or .full_tensor() for the whole tensor (on every rank)"
            )
        local_args, local_kwargs = pytree.tree_map_only(ShardedPart, lambda p: p._local_tensor, (args, kwargs))
        out = func(*local_args, **local_kwargs)
        if args and isinstance(args[0], ShardedPart) and out is local_args[0]:
            return args[0]  # in place: the part itself
        return pytree.tree_map_only(torch.Tensor, first._like, out)


class ShardGroup:
    """A sharded model's shard group as torch's checkpointing sees it: each parameter's
    ``PartExtent`` (by every name of it, and by the parameter), the communicator parts gather over,
    and a DTensor mesh of its ranks."""

    def __init__(self, flats: list[FlatParam], layout: Layout):
        self.comm = layout.shard
        self.by_name: dict[str, PartExtent] = {}
        self.by_param: dict[torch.Tensor, PartExtent] = {}
        for flat in flats:
            for slot, param, _ in flat.held_parts():
                part = PartExtent(flat.packing, slot, self.comm.rank, layout.writes_shards)
                self.by_name.update(dict.fromkeys(slot.names, part))
                self.by_param[param] = part

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        return DeviceMesh.from_group(self.comm.group, self.comm.device.type)

    def part(self, local: torch.Tensor, extent: PartExtent, *, scalar: bool = False,
             what: str | None = None) -> ShardedPart:
        return ShardedPart(local, extent, self, scalar=scalar, what=what)


def local_part(value: Any, extent: PartExtent, what: str, *, scalar: bool = False) -> Any:
    """``value`` as this rank keeps it, for ``load_state_dict``: a part of ``extent`` as its local
    tensor; a whole tensor (plain, or a replicated DTensor) cut to this rank's run (a copy, so the
    whole can be freed) unless it is a ``scalar`` (which only a 0-dim parameter's whole per-element
    state looks like); anything else as it is. A part cut another way, or a DTensor sharded
    otherwise, cannot be cut here without collectives and is refused."""
    if isinstance(value, ShardedPart):
        if not value._extent.same_cut(extent):
            raise ValueError(
                f"{what} is shardwire's part of another layout (rank {value._extent.rank} of "
                f"{value._extent.packing.world_size}, elements {value._extent.held}): reshard it by loading "
                f"the checkpoint with torch.distributed.checkpoint.load into this model's state dict"
            )
        return value._local_tensor
    if isinstance(value, DTensor):
        if not all(p.is_replicate() for p in value.placements):
            raise ValueError(
                f"{what} is a DTensor placed {value.placements}: load DTensor state dicts with "
                f"torch.distributed.checkpoint.load into the sharded model's state dict, which reshards them"
            )
        value = value.to_local()
    if scalar or not isinstance(value, torch.Tensor) or value.shape != extent.shape:
        return value
    start, end = extent.held
    return value.reshape(-1)[start:end].clone()
