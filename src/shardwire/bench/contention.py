"""How much of a device's compute a running collective takes: ``shardwire bench --contention``.

Communication that overlaps compute is not free for it. NCCL runs its rings as kernels on the GPU's
own SMs and through its memory; gloo's threads take the CPU's cores and memory bandwidth from the
matrix multiplies. The simulator models this as each level's ``compute_share``: while a collective
of that level is in flight, compute runs at ``1 - share`` of its speed (``shardwire.sim.events``).

This measures it. On each measured group, every rank of the world times a fixed matrix-multiply
workload alone, then again while the group's members keep an all-gather of ``--max-bytes``
running (issued as the benchmark issues it: torch's collective or the engine's transport, on the
benchmark's wire). The all-gathers are queued before the workload starts, enough of them to outlast
it: a rank that sees the last one finished before its workload did (so that part of the workload ran
alone) makes every rank try again with twice as many. A member's share is ``1 - alone / beside``
(medians of a few trials), clamped to [0, 1); the group's is the median over its members, which is
what ``shardwire simulate --cluster-from`` reads. Ranks outside the group compute in both phases, so
that what they take from a shared machine is the same alone and beside.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwire.bench import report
from shardwire.bench.ops import OUT_OF_PLACE, AllGather, OpContext
from shardwire.comm.clock import Clock

TRIALS = 5
# Retries, each with twice the all-gathers, before the workload is declared too long to cover.
DOUBLINGS = 4
# The chain of all-gathers counts as having outlasted the workload when waiting for it, once the
# workload is done, takes at least this share of one all-gather: the last one was still running.
STILL_RUNNING = 0.1


class ContentionError(Exception):
    """The all-gathers could not be kept running for the whole workload; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """``count`` products of two ``n`` x ``n`` matrices in ``dtype``: a fixed amount of the compute
    that training does, sized to take a fraction of a second on the device."""

    n: int
    dtype: torch.dtype
    count: int

    @classmethod
    def for_device(cls, device: torch.device) -> "Workload":
        if device.type == "cuda":
            return cls(8192, torch.bfloat16, 50)  # about 1.1 TFLOP each: 70 ms on an H100
        return cls(1024, torch.float32, 8)

    def describe(self) -> dict:
        return {"op": "matmul", "n": self.n, "dtype": str(self.dtype).removeprefix("torch."), "count": self.count}

    def prepare(self, device: torch.device) -> Callable[[], None]:
        """The workload as a function, its operands allocated once."""
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(self.n, self.n, generator=generator, device=device).to(self.dtype)
        b = torch.randn(self.n, self.n, generator=generator, device=device).to(self.dtype)
        out = torch.empty_like(a)

        def run() -> None:
            for _ in range(self.count):
                torch.mm(a, b, out=out)

        run()  # warm up kernels and caches
        return run


def measure(contexts: dict[str, OpContext], nbytes: int, device: torch.device,
            say: Callable[[str], None]) -> dict:
    """The contention section of the bench JSON: the workload, and for each group the all-gather's
    size, the medians alone and beside it and the compute share (schema in ``shardwire.bench.report``)."""
    workload = Workload.for_device(device)
    run = workload.prepare(device)
    clock = Clock(device)
    section: dict = {"workload": workload.describe()}
    for name, ctx in contexts.items():
        section[name] = _measure_group(ctx, nbytes, run, clock)
        say(report.contention_line(name, section["workload"], section[name]))
    return section


def _measure_group(ctx: OpContext, nbytes: int, run: Callable[[], None], clock: Clock) -> dict:
    numel = max(nbytes // ctx.dtype.itemsize // ctx.size, 1) * ctx.size
    gather = AllGather(ctx, numel, OUT_OF_PLACE) if ctx.member else None
    alone = statistics.median(_timed(run, clock, None, 0)[0] for _ in range(TRIALS))
    one_gather = statistics.median(_timed(_idle, clock, gather, 1)[1] for _ in range(3))  # 0 outside the group
    # enough all-gathers to outlast the workload by half again, agreed by every rank
    count = _agree_max(math.ceil(1.5 * alone / one_gather) + 1 if gather else 1, ctx.device)
    for _ in range(DOUBLINGS + 1):
        trials = [_timed(run, clock, gather, count) for _ in range(TRIALS)]
        covered = gather is None or all(tail >= STILL_RUNNING * one_gather for _, tail in trials)
        if _agree_max(0 if covered else 1, ctx.device) == 0:
            break
        count *= 2
    else:
        raise ContentionError(
            f"{count // 2} all-gathers of {numel * ctx.dtype.itemsize} bytes finished before the matrix "
            f"multiplies on some rank of the {ctx.size}-rank group: raise --max-bytes"
        )
    beside = statistics.median(seconds for seconds, _ in trials)
    share = min(max(1.0 - alone / beside, 0.0), math.nextafter(1.0, 0.0))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (ctx.member, alone, beside, share))
    members = [(a, b, s) for member, a, b, s in everyone if member]
    return {
        "ranks": ctx.size,
        "all_gather_bytes": numel * ctx.dtype.itemsize,
        "alone_s": statistics.median(a for a, _, _ in members),
        "beside_s": statistics.median(b for _, b, _ in members),
        "compute_share": statistics.median(s for _, _, s in members),
        "rank_shares": [s for _, _, s in members],
    }


def _timed(run: Callable[[], None], clock: Clock, gather: AllGather | None, count: int) -> tuple[float, float]:
    """Seconds of ``run()`` with ``count`` all-gathers queued before it, and seconds spent after it
    waiting for them; every rank of the world starts together."""
    dist.barrier()
    handles = [handle for _ in range(count) for handle in gather.issue()] if gather else []
    start = clock.stamp()
    run()
    done = clock.stamp()
    for handle in handles:
        handle.wait()
    landed = clock.stamp()
    if clock.cuda:
        torch.cuda.synchronize(clock.device)
    return clock.seconds(done) - clock.seconds(start), clock.seconds(landed) - clock.seconds(done)


def _idle() -> None:
    pass


def _agree_max(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
