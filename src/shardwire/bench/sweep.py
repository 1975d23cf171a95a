"""Running a sweep: the sizes, timing one operation on one rank, and combining the ranks' results.

Each size is measured as nccl-tests measures it: ``warmup`` untimed operations, a barrier of the
group, then ``iters`` operations timed together (issued back to back and waited at the end, or each
waited before the next is issued with ``blocking``); their total time over ``iters`` is the time
per operation. On GPUs the time is taken by CUDA events on the stream that waits for the operations;
on CPUs by a monotonic clock around issuing them and waiting for their handles. After each size the
world exchanges every rank's times and wrong-element counts, so every rank holds each row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardwire.bench.metrics import (
    LatencyBandwidthFit,
    Saturation,
    bandwidth,
    combine_ranks,
    fit_latency_bandwidth,
    saturation,
)
from shardwire.bench.ops import IN_PLACE, OUT_OF_PLACE, OpContext, Operation
from shardwire.comm.errors import collective_failed, failed_collective

PLACEMENTS = (OUT_OF_PLACE, IN_PLACE)


def sweep_sizes(min_bytes: int, max_bytes: int, *, factor: int | None = None, step: int | None = None) -> list[int]:
    """Sizes from ``min_bytes`` up to ``max_bytes``, each ``factor`` times (or ``step`` bytes more
    than) the one before."""
    if (factor is None) == (step is None):
        raise ValueError("give exactly one of factor and step")
    if not 0 < min_bytes <= max_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    if (factor is not None and factor < 2) or (step is not None and step < 1):
        raise ValueError("the factor must be at least 2 and the step at least 1 byte")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = size * factor if factor is not None else size + step
    return sizes


def aligned_sizes(sizes: list[int], align: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``sizes`` rounded up to multiples of ``align`` bytes, without repeats, and the (asked, used)
    pairs that rounding changed."""
    used, changed = [], []
    for size in sizes:
        rounded = -(-size // align) * align
        if rounded != size:
            changed.append((size, rounded))
        if rounded not in used:
            used.append(rounded)
    return used, changed


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    warmup: int
    iters: int
    blocking: bool  # wait for each operation before issuing the next
    check: bool  # count wrong output elements after the timed operations
    combine: str  # how ranks' times combine: max, min or avg


@dataclasses.dataclass(frozen=True)
class Point:
    """One form of an operation at one size, over the group's ranks."""

    seconds: float
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    wrong: int | None  # summed over the group's ranks; None when not checked


@dataclasses.dataclass(frozen=True)
class Row:
    nbytes: int
    count: int
    points: dict[str, Point]  # by placement, for the forms the operation has
    wire_nbytes: int | None = None  # the size as sent, where --wire quantized it (as a rank in the group sees it)


def sweep(operation: type[Operation], numels: list[int], ctx: OpContext, settings: SweepSettings) -> Iterator[Row]:
    """Measure ``operation`` with each element count in ``numels`` on the group of ``ctx``.

    Every rank of the world runs the sweep in step, those outside the group only to take part in
    the exchange after each size, and every rank gets each row as soon as its size is done.
    """
    for numel in numels:
        mine = []
        nbytes = numel * ctx.dtype.itemsize
        with _in_one_line(f"{operation.name} of {nbytes:,} bytes"):
            for placement in PLACEMENTS:
                if ctx.member and placement in operation.forms:
                    seconds, wrong = measure(operation(ctx, numel, placement), settings)
                    mine += [seconds, math.nan if wrong is None else wrong]
                else:
                    mine += [math.nan, math.nan]
            everyone = exchange(mine, ctx.device)
        points = {}
        for i, placement in enumerate(PLACEMENTS):
            if placement in operation.forms:
                measured = [values[2 * i : 2 * i + 2] for values in everyone]
                points[placement] = _over_ranks(operation.name, nbytes, ctx.size, measured, settings)
        yield Row(nbytes=nbytes, count=operation.call_count(numel, ctx.size), points=points,
                  wire_nbytes=_as_sent(operation, numel, ctx))


@contextlib.contextmanager
def _in_one_line(what: str) -> Iterator[None]:
    """Within it, a collective of torch's that fails (a peer gone, a link cut past ``--timeout``) is a
    ``CollectiveError`` naming ``what`` was measured, which a worker says in one line, as the engine's
    transport says its own."""
    try:
        yield
    except RuntimeError as err:
        if not failed_collective(err):
            raise
        raise collective_failed(err, what) from err


def _as_sent(operation: type[Operation], numel: int, ctx: OpContext) -> int | None:
    """The size as the engine's transport sends it on a quantized wire; None where nothing is quantized."""
    codec = operation.codec_of(ctx.wire)
    if ctx.comm is None or not ctx.comm.quantizes(codec):
        return None
    return ctx.comm.wire_nbytes(operation.name, numel // ctx.size, ctx.dtype.itemsize, codec)


def _over_ranks(op: str, nbytes: int, ranks: int, measured: list[list[float]], settings: SweepSettings) -> Point:
    """One point from each world rank's (seconds, wrong), NaN on ranks outside the group."""
    members = [(seconds, wrong) for seconds, wrong in measured if not math.isnan(seconds)]
    seconds = combine_ranks([seconds for seconds, _ in members], settings.combine)
    rate = bandwidth(op, nbytes, seconds, ranks)
    wrong = int(sum(wrong for _, wrong in members)) if settings.check else None
    return Point(seconds, rate.algbw, rate.busbw, wrong)


def measure(op: Operation, settings: SweepSettings) -> tuple[float, int | None]:
    """This rank's mean seconds per operation, and its wrong output elements when checking."""
    _run(op, settings.warmup, settings.blocking)
    dist.barrier(group=op.ctx.group)
    seconds = _seconds_per_op(op, settings.iters, settings.blocking)
    if not settings.check:
        return seconds, None
    op.fill()
    _run(op, 1, blocking=True)
    return seconds, op.count_wrong()


def first_failure(operations: list[type[Operation]], ctx: OpContext) -> str | None:
    """Run every form of each operation once, one element per rank; describe the first that fails.

    Backends lack some operations for some dtypes (gloo has no float8 collectives, only float8
    point-to-point) and say so only when asked to run one, so this asks before anything is measured.
    """
    for operation in operations:
        for placement in operation.forms:
            try:
                op = operation(ctx, ctx.size, placement)
                op.fill()
                _run(op, 1, blocking=True)
            except (RuntimeError, ValueError, TypeError) as err:
                what = f"{operation.name} with redop {ctx.redop}" if operation.reduces else operation.name
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                dtype = str(ctx.dtype).removeprefix("torch.")
                return f"{dist.get_backend(ctx.group)} could not run {what} on {dtype} ({reason})"
    return None


def _run(op: Operation, iterations: int, blocking: bool) -> None:
    pending = []
    for _ in range(iterations):
        pending.extend(op.issue())
        if blocking:
            for handle in pending:
                handle.wait()
            pending.clear()
            if op.ctx.device.type == "cuda":
                torch.cuda.current_stream(op.ctx.device).synchronize()
    for handle in pending:
        handle.wait()  # on CUDA: orders the current stream after the operation, no host sync


def _seconds_per_op(op: Operation, iterations: int, blocking: bool) -> float:
    if op.ctx.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _run(op, iterations, blocking)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iterations
    began = time.perf_counter()
    _run(op, iterations, blocking)
    return (time.perf_counter() - began) / iterations


def exchange(values: list[float], device: torch.device) -> list[list[float]]:
    """Every world rank's ``values``, in rank order."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [tensor.tolist() for tensor in everyone]


@dataclasses.dataclass
class OpResult:
    """One operation swept on one measured group."""

    group: str  # world, intra or inter
    ranks: int  # ranks in the group
    op: str
    dtype: str
    redop: str | None  # None for operations that do not reduce
    root: int | None  # None for operations without a root
    placement: str  # the form the summary and the fit describe: out-of-place where the op has it
    rows: list[Row] = dataclasses.field(default_factory=list)

    def sizes_and_points(self) -> tuple[list[int], list[Point]]:
        return [row.nbytes for row in self.rows], [row.points[self.placement] for row in self.rows]

    def saturation(self) -> Saturation:
        sizes, points = self.sizes_and_points()
        return saturation(sizes, [p.busbw for p in points])

    def fit(self) -> LatencyBandwidthFit | None:
        sizes, points = self.sizes_and_points()
        return fit_latency_bandwidth(sizes, [p.seconds for p in points])

    @property
    def wrong(self) -> int:
        return sum(p.wrong or 0 for row in self.rows for p in row.points.values())
