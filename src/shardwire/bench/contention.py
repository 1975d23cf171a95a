"""What compute and a running collective take from each other: ``shardwire bench --contention``.

Communication that overlaps compute is not free for it, nor compute for communication. NCCL runs
its rings as kernels on the GPU's own SMs and through its memory; gloo's threads take the CPU's
cores and memory bandwidth from the matrix multiplies, and the multiplies take them from the
threads. The simulator models each level with two shares (``shardwire.sim.events``): while a
collective of that level is in flight, compute runs at ``1 - compute_share`` of its speed; while
compute runs, the level's collectives move bytes at ``1 - bandwidth_share`` of theirs.

This measures it. On each measured group, every rank of the world times a fixed matrix-multiply
workload alone, then again while the group's members keep an all-gather of ``--max-bytes``
running (issued as the benchmark issues it: torch's collective or the engine's transport, on the
benchmark's wire). The all-gathers are queued before the workload starts, enough of them to outlast
it: a rank that sees the last one finished before its workload did (so that part of the workload ran
alone) makes every rank try again with twice as many. A member's share is ``1 - alone / beside``
(medians of a few trials), clamped to [0, 1]; the group's is the median over its members, which is
what ``shardwire simulate --cluster-from`` reads. Ranks outside the group compute in both phases, so
that what they take from a shared machine is the same alone and beside.

The bandwidth share comes from the same trials. Once the workload is done, each all-gather is
waited for in turn and the time stamped after each wait: those that landed while the workload ran
return at once, and the first that did not lands ``left`` seconds later, running alone, so
``left / one`` of it was still to do (``one``: an all-gather's time alone). What the all-gathers
moved beside the workload, in all-gathers, is ``moved = landed + 1 - left / one``, where alone they
would have moved ``beside / one``: ``bandwidth_share = 1 - moved * one / beside``.
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
from shardwire.bench.sweep import exchange
from shardwire.comm.clock import Clock

TRIALS = 5
# Retries, each with twice the all-gathers, before the workload is declared too long to cover.
DOUBLINGS = 4
# The chain of all-gathers counts as having outlasted the workload when waiting for it, once the
# workload is done, takes at least this share of one all-gather: the last one was still running.
STILL_RUNNING = 0.1
# An all-gather whose wait, after the workload, takes under this share of one all-gather had landed.
LANDED = 0.01


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
    one_gather = statistics.median(_last(_timed(_idle, clock, gather, 1)[1]) for _ in range(3))  # 0 outside
    # enough all-gathers to outlast the workload by half again, agreed by every rank
    count = _agree_max(math.ceil(1.5 * alone / one_gather) + 1 if gather else 1, ctx.device)
    for _ in range(DOUBLINGS + 1):
        trials = [_timed(run, clock, gather, count) for _ in range(TRIALS)]
        covered = gather is None or all(_last(lands) >= STILL_RUNNING * one_gather for _, lands in trials)
        if _agree_max(0 if covered else 1, ctx.device) == 0:
            break
        count *= 2
    else:
        raise ContentionError(
            f"{count // 2} all-gathers of {numel * ctx.dtype.itemsize} bytes finished before the matrix "
            f"multiplies on some rank of the {ctx.size}-rank group: raise --max-bytes"
        )
    beside = statistics.median(seconds for seconds, _ in trials)
    share = _share(1.0 - alone / beside)
    slowed = _share(statistics.median(_bandwidth_share(lands, one_gather, seconds) for seconds, lands in trials)
                    if gather else 0.0)
    mine = [alone, beside, share, one_gather, slowed] if ctx.member else [math.nan] * 5
    members = [values for values in exchange(mine, ctx.device) if not math.isnan(values[0])]
    return {
        "ranks": ctx.size,
        "all_gather_bytes": numel * ctx.dtype.itemsize,
        "alone_s": statistics.median(m[0] for m in members),
        "beside_s": statistics.median(m[1] for m in members),
        "compute_share": statistics.median(m[2] for m in members),
        "rank_shares": [m[2] for m in members],
        "all_gather_s": statistics.median(m[3] for m in members),
        "bandwidth_share": statistics.median(m[4] for m in members),
        "rank_bandwidth_shares": [m[4] for m in members],
    }


def _share(value: float) -> float:
    return min(max(value, 0.0), 1.0)


def _bandwidth_share(lands: list[float], one: float, beside: float) -> float:
    """What the workload took from the all-gathers queued before it (see the module docstring), from
    how long after the workload each landed."""
    landed = sum(1 for left in lands if left < LANDED * one)
    left = next(left for left in lands if left >= LANDED * one)  # the chain outlasts the workload
    moved = landed + 1.0 - min(1.0, left / one)
    return 1.0 - moved * one / beside


def _last(lands: list[float]) -> float:
    return lands[-1] if lands else 0.0


def _timed(run: Callable[[], None], clock: Clock, gather: AllGather | None,
           count: int) -> tuple[float, list[float]]:
    """Seconds of ``run()`` with ``count`` all-gathers queued before it, and for each all-gather the
    seconds after it until the all-gather had landed; every rank of the world starts together.
    On CUDA the stamps are events after each wait, which orders the stream after the collective."""
    dist.barrier()
    issued = [gather.issue() for _ in range(count)] if gather else []
    start = clock.stamp()
    run()
    done = clock.stamp()
    stamps = []
    for handles in issued:
        for handle in handles:
            handle.wait()
        stamps.append(clock.stamp())
    if clock.cuda:
        torch.cuda.synchronize(clock.device)
    after = clock.seconds(done)
    return after - clock.seconds(start), [clock.seconds(stamp) - after for stamp in stamps]


def _idle() -> None:
    pass


def _agree_max(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
