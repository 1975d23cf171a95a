"""The operations ``shardwire bench`` measures: each one's buffers, how it is issued, and the exact
result it must leave on every rank.

Buffers are laid out as nccl-tests lays them out. With ``N`` elements in the operation's whole
buffer (its size S in bytes over the element size), ``n`` ranks and ``c = N / n``:

==============  ===========================  ===========================  =======================
operation       input                        output                       in-place form
==============  ===========================  ===========================  =======================
all_reduce      N                            the input                    only in-place
broadcast       N                            the input                    only in-place
reduce          N                            the input (root's counts)    only in-place
all_gather      c                            N                            input = output piece r
reduce_scatter  N                            c                            output = input piece r
all_to_all      N                            N                            none
sendrecv        N, sent to rank r+1          N, from rank r-1             none
==============  ===========================  ===========================  =======================

torch.distributed has no out-of-place all_reduce, broadcast or reduce, and in-place all_to_all or
sendrecv would overwrite what is still being sent, so each operation is measured in the forms
listed. The ``count`` reported is the count the collective is called with, as nccl-tests prints
it: ``c`` for all_gather, reduce_scatter and all_to_all, ``N`` otherwise.

Timed operations run on zeroed buffers (what they carry does not change how long they take). For
``--check`` one more runs after them on filled inputs: every rank's input is pseudo-random integers
that any rank can regenerate from the rank's number, so each rank knows every element its output
must hold. Inputs of reductions are +-1 (0 or 1 for unsigned types): every partial sum, product,
min or max of those is an integer no larger than the group, exact in the dtype up to
``exact_sum_limit`` ranks in whatever order the backend adds them, so results are compared bit for
bit. Other operations move wider values, so a misplaced piece shows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.distributed as dist

from shardwire.comm.communicator import Communicator, torch_all_gather, torch_reduce_scatter
from shardwire.comm.wire import Codec, Wire

IN_PLACE, OUT_OF_PLACE = "in_place", "out_of_place"

REDOPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                 "int8", "uint8", "int32", "int64")
}

_SEED = 0x5EED
_MOVED_VALUES = 100  # moved (not reduced) inputs span -100..100, or 0..200 for unsigned types


def exact_sum_limit(dtype: torch.dtype) -> int:
    """The most ranks whose +-1 inputs still sum exactly in ``dtype`` (every integer up to it is exact)."""
    if dtype.is_floating_point:
        return int(2 / torch.finfo(dtype).eps)
    return torch.iinfo(dtype).max


@dataclasses.dataclass(frozen=True)
class OpContext:
    """Where and how to run operations: one rank's view of one measured group."""

    group: dist.ProcessGroup | None  # None on ranks outside the group
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int | None  # this rank's place in the group; None outside it
    device: torch.device
    dtype: torch.dtype
    redop: str
    root: int  # group rank of broadcast's source and reduce's destination
    # the engine's transport for all_gather and reduce_scatter (--impl shardwire); None: torch's
    # collectives, and on ranks outside the group
    comm: Communicator | None
    wire: Wire = Wire()  # what the engine's transport sends between nodes (--wire)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def member(self) -> bool:
        return self.rank is not None

    def close(self) -> None:
        """Stop the communicator's threads, if this rank has one."""
        if self.comm is not None:
            self.comm.close()

    def rank_input(self, rank: int, numel: int, *, reduced: bool) -> torch.Tensor:
        """The deterministic input that group rank ``rank`` contributes (see the module docstring)."""
        generator = torch.Generator(device=self.device).manual_seed(_SEED + rank)
        signed = self.dtype.is_signed
        if reduced:
            values = torch.randint(0, 2, (numel,), generator=generator, device=self.device)
            values = values * 2 - 1 if signed else values
        else:
            low = -_MOVED_VALUES if signed else 0
            values = torch.randint(low, low + 2 * _MOVED_VALUES + 1, (numel,), generator=generator,
                                   device=self.device)
        return values.to(self.dtype)

    def reduction_of_inputs(self, numel: int) -> torch.Tensor:
        """The reduction over all group ranks of their reduced inputs, computed exactly."""
        wide = torch.promote_types(self.dtype, torch.float32) if self.dtype.is_floating_point else self.dtype
        combine = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}[self.redop]
        result = self.rank_input(0, numel, reduced=True).to(wide)
        for rank in range(1, self.size):
            result = combine(result, self.rank_input(rank, numel, reduced=True).to(wide))
        return result.to(self.dtype)


class Operation:
    """One operation at one size and form on one rank: its buffers, issue() and the expected output."""

    name: ClassVar[str]
    forms: ClassVar[tuple[str, ...]]  # the placements torch.distributed offers; summaries describe the first
    split: ClassVar[bool] = False  # the buffer is cut in one piece per rank (its size rounds to n elements)
    reduces: ClassVar[bool] = False
    rooted: ClassVar[bool] = False
    engine: ClassVar[bool] = False  # the engine's transport runs it with --impl shardwire; torch's otherwise

    def __init__(self, ctx: OpContext, numel: int, placement: str):
        if placement not in self.forms:
            raise ValueError(f"{self.name} has no {placement} form")
        self.ctx, self.numel, self.placement = ctx, numel, placement
        self.piece = numel // ctx.size
        self.input, self.output = self._buffers()

    @classmethod
    def call_count(cls, numel: int, ranks: int) -> int:
        """The element count the collective is called with (nccl-tests' count column)."""
        return numel // ranks if cls.split else numel

    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.ctx.dtype, device=self.ctx.device)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = self._zeros(self.numel)
        return buffer, buffer

    def fill(self) -> None:
        """Write this rank's deterministic input."""
        self.input.copy_(self.ctx.rank_input(self.ctx.rank, self.input.numel(), reduced=self.reduces))

    def issue(self) -> list:
        """Start the operation; returns handles whose wait() completes it."""
        raise NotImplementedError

    def expected(self) -> torch.Tensor | None:
        """What the output must hold after one operation on filled inputs (None: nothing defined)."""
        raise NotImplementedError

    @classmethod
    def codec_of(cls, wire: Wire) -> Codec | None:
        """The codec the engine's transport quantizes this operation with on ``wire``, if any."""
        return None

    def count_wrong(self) -> int:
        """Output elements that differ, bit for bit, from their expected values; on a quantized wire,
        by more than quantization may move them: half a step of the largest input for a gather, and
        for a reduction that for each rank's contribution (every partial sum is quantized at most
        once, and holds at most every rank's input)."""
        expected = self.expected()
        if expected is None:
            return 0
        codec = self.codec_of(self.ctx.wire)
        if self.ctx.comm is None or not self.ctx.comm.quantizes(codec):
            return int((_bits(self.output) != _bits(expected)).sum())
        largest = max(float(self.ctx.rank_input(q, self.input.numel(), reduced=self.reduces).abs().max())
                      for q in range(self.ctx.size))
        contributions = self.ctx.size if self.reduces else 1
        bound = contributions * largest / codec.largest / 2 * (1 + 1e-6)
        return int(((self.output.double() - expected.double()).abs() > bound).sum())

    def _global(self, group_rank: int) -> int:
        return self.ctx.ranks[group_rank]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that comparisons are exact (no NaN or -0 semantics)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


class AllReduce(Operation):
    name, forms, reduces = "all_reduce", (IN_PLACE,), True

    def issue(self):
        return [dist.all_reduce(self.output, op=REDOPS[self.ctx.redop], group=self.ctx.group, async_op=True)]

    def expected(self):
        return self.ctx.reduction_of_inputs(self.numel)


class Reduce(Operation):
    name, forms, reduces, rooted = "reduce", (IN_PLACE,), True, True

    def issue(self):
        return [dist.reduce(self.output, dst=self._global(self.ctx.root), op=REDOPS[self.ctx.redop],
                            group=self.ctx.group, async_op=True)]

    def expected(self):
        return self.ctx.reduction_of_inputs(self.numel) if self.ctx.rank == self.ctx.root else None


class Broadcast(Operation):
    name, forms, rooted = "broadcast", (IN_PLACE,), True

    def issue(self):
        return [dist.broadcast(self.output, src=self._global(self.ctx.root), group=self.ctx.group, async_op=True)]

    def expected(self):
        return self.ctx.rank_input(self.ctx.root, self.numel, reduced=False)


class AllGather(Operation):
    name, forms, split, engine = "all_gather", (OUT_OF_PLACE, IN_PLACE), True, True

    def _buffers(self):
        output = self._zeros(self.numel)
        if self.placement == IN_PLACE:
            return output.narrow(0, self.ctx.rank * self.piece, self.piece), output
        return self._zeros(self.piece), output

    @classmethod
    def codec_of(cls, wire):
        return wire.param_codec

    def issue(self):
        ctx = self.ctx
        if ctx.comm is not None:
            return [ctx.comm.all_gather(self.output, self.input, tag="bench", codec=self.codec_of(ctx.wire))]
        return [torch_all_gather(self.output, self.input, group=ctx.group, async_op=True)]

    def expected(self):
        return torch.cat([self.ctx.rank_input(q, self.piece, reduced=False) for q in range(self.ctx.size)])


class ReduceScatter(Operation):
    name, forms, split, reduces, engine = "reduce_scatter", (OUT_OF_PLACE, IN_PLACE), True, True, True

    def _buffers(self):
        full = self._zeros(self.numel)
        if self.placement == IN_PLACE:
            return full, full.narrow(0, self.ctx.rank * self.piece, self.piece)
        return full, self._zeros(self.piece)

    @classmethod
    def codec_of(cls, wire):
        return wire.grad_codec

    def issue(self):
        ctx = self.ctx
        if ctx.comm is not None:  # no error feedback: each call stands alone, as nccl-tests' do
            return [ctx.comm.reduce_scatter(self.output, self.input, tag="bench", codec=self.codec_of(ctx.wire))]
        return [torch_reduce_scatter(self.output, self.input, op=REDOPS[ctx.redop], group=ctx.group, async_op=True)]

    def expected(self):
        return self.ctx.reduction_of_inputs(self.numel).narrow(0, self.ctx.rank * self.piece, self.piece)


class AllToAll(Operation):
    name, forms, split = "all_to_all", (OUT_OF_PLACE,), True

    def _buffers(self):
        return self._zeros(self.numel), self._zeros(self.numel)

    def issue(self):
        return [dist.all_to_all_single(self.output, self.input, group=self.ctx.group, async_op=True)]

    def expected(self):
        mine = slice(self.ctx.rank * self.piece, (self.ctx.rank + 1) * self.piece)
        return torch.cat([self.ctx.rank_input(q, self.numel, reduced=False)[mine] for q in range(self.ctx.size)])


class SendRecv(Operation):
    """A ring: every rank sends its buffer to the next rank and receives the previous rank's."""

    name, forms = "sendrecv", (OUT_OF_PLACE,)

    def _buffers(self):
        return self._zeros(self.numel), self._zeros(self.numel)

    def issue(self):
        ctx = self.ctx
        following, preceding = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self.input, self._global(following), ctx.group),
            dist.P2POp(dist.irecv, self.output, self._global(preceding), ctx.group),
        ])

    def expected(self):
        return self.ctx.rank_input((self.ctx.rank - 1) % self.ctx.size, self.numel, reduced=False)


OPERATIONS: dict[str, type[Operation]] = {
    op.name: op for op in (AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, AllToAll, SendRecv)
}
