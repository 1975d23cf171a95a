"""The collective benchmark behind ``shardwire bench``: what the network delivers to collectives, in
the numbers nccl-tests prints, measured from Python with whatever backend torch.distributed has
(NCCL on GPUs, gloo on CPUs). For each measured group and operation it sweeps sizes and reports
nccl-tests' table (time, algbw, busbw, #wrong, out-of-place and in-place), then the operation's
saturation summary and latency-bandwidth fit; ``BenchConfig`` holds the settings (each one an
option of the command).

Groups: ``world`` is every rank; ``intra`` is each node's ranks among themselves (all nodes at
once); ``inter`` is one rank per node, so that what crosses between nodes is measured alone. Which
ranks share a node comes from the launch (torchrun's ``LOCAL_WORLD_SIZE``, or SLURM's tasks per node
for an srun step of these ranks: ``shardwire.placement.launch_ranks_per_node``), or ``--ranks-per-node``.

The pieces, beside this module in ``shardwire.bench``: ``metrics`` (definitions of the numbers),
``ops`` (the operations, their buffers and the expected results), ``sweep`` (timing and combining
ranks), ``report`` (table, JSON schema, CSV, plot).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import platform
import re
import shlex
import socket
from collections.abc import Callable
from typing import TextIO

import torch
import torch.distributed as dist

from shardwire import worker
from shardwire.bench import contention, report
from shardwire.bench.metrics import COMBINE, OPS
from shardwire.bench.ops import DTYPES, OPERATIONS, REDOPS, OpContext, Operation, exact_sum_limit
from shardwire.bench.sweep import OpResult, SweepSettings, aligned_sizes, first_failure, sweep, sweep_sizes
from shardwire.comm.communicator import Communicator
from shardwire.comm.groups import inter_node_group, intra_node_group
from shardwire.comm.wire import Wire
from shardwire.extras import require
from shardwire.mappings import shown
from shardwire.options import (MAX_TIMEOUT_S, OptionError, SettingError, check_bounds, check_distinct_outputs,
                               check_output_file, option)
from shardwire.placement import Placement, launch_ranks_per_node

GROUPS = ("world", "intra", "inter")
# More sizes than this is a mistake (-b 1 -e 1G -i 1 is a billion), not a sweep anyone waits for.
MAX_SIZES = 1000
_TRANSPORT_ENV = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_GLOO_", "FI_")


class BenchError(Exception):
    """Input the benchmark cannot run with, or an operation the backend cannot run; the message says
    what to change."""


_SIZE_DIGITS = 18  # an exabyte: beyond any machine's memory, and within what int() reads


def parse_size(text: str) -> int:
    """Bytes, with an optional binary suffix as nccl-tests takes them: 8, 64K, 128M, 1G (or 1GiB)."""
    match = re.fullmatch(r"([0-9]+)([KMGT]?)(i?B)?", text.strip(), re.IGNORECASE)  # \d takes any script's digits
    if match is None:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a size: give bytes with an optional K, M, G or T, "
                                         f"e.g. 64K")
    if len(match[1].lstrip("0")) > _SIZE_DIGITS:
        raise argparse.ArgumentTypeError(f"{shown(text)} is more bytes than any machine holds: give bytes with an "
                                         f"optional K, M, G or T, e.g. 64K")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))


@dataclasses.dataclass
class BenchConfig:
    """The benchmark's settings; each but ``argv`` is a ``shardwire bench`` option and a key of its
    ``--config`` file."""

    ops: list[str] = option(factory=lambda: list(OPS), help=f"operations to measure (default: all of "
                            f"{', '.join(OPS)})", choices=OPS, metavar="OP")
    nproc: int = option(2, "local worker processes (ignored under torchrun)", at_least=1)
    min_bytes: int = option(1 << 10, "smallest size (default 1K)", flags=("-b",), parse=parse_size, at_least=1)
    max_bytes: int = option(64 << 20, "largest size (default 64M)", flags=("-e",), parse=parse_size)
    step_factor: int | None = option(None, "multiply the size by this between steps (default 2)", flags=("-f",),
                                     at_least=2)
    step_bytes: int | None = option(None, "add this many bytes between steps instead", flags=("-i",),
                                    parse=parse_size, at_least=1)
    dtype: str = option("float32", "element type", choices=DTYPES)
    redop: str = option("sum", "reduction of all_reduce, reduce_scatter and reduce", choices=REDOPS)
    root: int = option(0, "group rank that broadcast sends from and reduce reduces to")
    warmup: int = option(5, "untimed operations per size", flags=("-w",), at_least=0)
    iters: int = option(20, "timed operations per size", flags=("-n",), at_least=1)
    blocking: bool = option(False, "wait for each operation before issuing the next")
    check: bool = option(False, "compare every output element with its known value (#wrong); exit 1 if any differs")
    combine: str = option("max", "how ranks' times combine", choices=COMBINE)
    groups: list[str] = option(factory=lambda: ["world"], help="world: all ranks; intra: each node's ranks; "
                               "inter: one rank per node (default world)", choices=GROUPS, metavar="GROUP")
    ranks_per_node: int | None = option(None, "ranks that share a node (default: torchrun's LOCAL_WORLD_SIZE, "
                                            "or SLURM's tasks per node)")
    impl: str = option("torch", "shardwire: time all_gather and reduce_scatter as the engine runs them "
                                "(shardwire.comm.communicator; point-to-point on gloo)", choices=("torch", "shardwire"))
    wire: str = option("none", "with --impl shardwire: quantize what crosses nodes, as shard(wire=...) does: int8, "
                               "or params=int8,grads=int4[,block=N] (all_gather uses params, reduce_scatter grads); "
                               "busbw stays on the uncompressed size, the bytes sent are reported beside it")
    backend: str = option("auto", "auto: NCCL when CUDA is available, else gloo", choices=worker.BACKENDS)
    timeout: float = option(300.0, "seconds before a collective that does not complete is an error",
                            at_least=worker.MIN_TIMEOUT_S, real=True, unit="seconds", at_most=MAX_TIMEOUT_S)
    contention: bool = option(False, "also time matrix multiplies alone and beside a running all_gather of "
                                     "--max-bytes on each group: the share of compute communication takes, which "
                                     "shardwire simulate --cluster-from reads")
    json: str | None = option(None, "save the results as JSON (schema: shardwire.bench.report)", metavar="PATH")
    csv: str | None = option(None, "save one CSV line per group, operation, size and form", metavar="PATH")
    plot: str | None = option(None, "save busbw against size as a PNG", metavar="PATH")
    argv: list[str] = dataclasses.field(default_factory=list)  # the command's arguments, saved with the results

    def __post_init__(self):
        self.ops, self.groups = list(dict.fromkeys(self.ops)), list(dict.fromkeys(self.groups))

    def sizes(self) -> list[int]:
        if self.step_bytes is not None:
            return sweep_sizes(self.min_bytes, self.max_bytes, step=self.step_bytes)
        return sweep_sizes(self.min_bytes, self.max_bytes, factor=self.step_factor or 2)

    def size_count(self) -> int:
        """How many sizes ``sizes()`` has, counted without building them: a small step over a wide
        range makes billions."""
        if self.step_bytes is not None:
            return (self.max_bytes - self.min_bytes) // self.step_bytes + 1
        return len(self.sizes())  # a factor of at least 2 reaches any size in a few dozen steps


def validate(config: BenchConfig, world: int) -> None:
    """Refuse, with what to change, everything that can be known wrong before a process group exists."""
    try:
        check_bounds(config)
        if int(os.environ.get("RANK", "0")) == 0:  # the rank that saves them
            for output, kind in (("json", "bench-json"), ("csv", "bench-csv"), ("plot", "bench-plot")):
                if getattr(config, output) is not None:
                    check_output_file(getattr(config, output), f"--{output}", kind)
            check_distinct_outputs([(f"--{output}", getattr(config, output)) for output in ("json", "csv", "plot")])
    except OptionError as err:
        raise BenchError(str(err)) from None
    if config.plot is not None:
        require("matplotlib", "--plot")
    if config.step_factor is not None and config.step_bytes is not None:
        raise BenchError("give --step-factor or --step-bytes, not both")
    if config.min_bytes > config.max_bytes:
        raise BenchError(f"--min-bytes ({config.min_bytes}) is larger than --max-bytes ({config.max_bytes})")
    count = config.size_count()
    if count > MAX_SIZES:
        raise BenchError(
            f"--min-bytes {config.min_bytes} to --max-bytes {config.max_bytes} makes {count} sizes, more than "
            f"{MAX_SIZES}: raise --step-bytes or --step-factor, or narrow the range"
        )
    try:
        launched = Placement.launched(world, config.ranks_per_node)
    except ValueError as err:
        raise BenchError(f"{err}: give --ranks-per-node a divisor of {world}") from None
    sizes = {name: len(groups[0]) for name, groups in _members(launched).items()}
    for name in config.groups:
        if sizes[name] < 2:
            raise BenchError(
                f"the {name} group would have {sizes[name]} rank ({launched.nodes} node(s) of "
                f"{launched.ranks_per_node} ranks): it needs at least 2; change --groups, --nproc or --ranks-per-node"
            )
    smallest = min(sizes[name] for name in config.groups)
    if not 0 <= config.root < smallest:
        raise BenchError(f"--root must be a rank of every measured group: 0 to {smallest - 1}, got {config.root}")
    reducing = [op for op in config.ops if OPERATIONS[op].reduces]
    largest = max(sizes[name] for name in config.groups)
    if config.check and config.redop == "sum" and reducing and largest > exact_sum_limit(DTYPES[config.dtype]):
        raise BenchError(
            f"--check cannot verify a sum over {largest} ranks exactly in {config.dtype} (exact up to "
            f"{exact_sum_limit(DTYPES[config.dtype])}): use a wider --dtype or leave {', '.join(reducing)} out of --ops"
        )
    try:
        wire = Wire.parse(config.wire)
    except SettingError as err:
        raise BenchError(err.as_options()) from None
    if wire.quantized and config.impl != "shardwire":
        raise BenchError("--wire quantizes the engine's own collectives: add --impl shardwire")
    if wire.quantized and not (launched.nodes > 1 and set(config.groups) - {"intra"}):
        raise BenchError(f"--wire quantizes only what crosses nodes, and no group measured does ({launched.nodes} "
                         f"node(s) of {launched.ranks_per_node} ranks, --groups {' '.join(config.groups)}): measure "
                         f"a group across nodes (--ranks-per-node treats this machine's processes as nodes), or "
                         f"leave out --wire")
    if config.impl == "shardwire" and config.redop != "sum" and "reduce_scatter" in config.ops:
        raise BenchError("--impl shardwire reduces by sum only: use --redop sum or leave reduce_scatter out of --ops")
    if (problem := worker.unavailable(config.backend)) is not None:
        raise BenchError(problem)
    local = launch_ranks_per_node(world)  # the ranks on this machine
    if (problem := worker.missing_gpus(config.backend, local)) is not None:
        raise BenchError(problem)
    # every operation holds a buffer of the whole size on each rank; the ranks of a node share its memory
    try:
        memory = worker.memory_per_worker(config.backend, local)
    except ValueError as err:
        raise BenchError(f"{err}: start fewer (--nproc)") from None
    if config.max_bytes > memory:
        raise BenchError(f"--max-bytes {config.max_bytes:,} is more than a worker here can hold "
                         f"({memory / 2**30:.3g} GiB): each rank holds a buffer of the largest size; lower it")


def _members(launched: Placement) -> dict[str, list[list[int]]]:
    """The ranks of each kind of group (intra: one group per node)."""
    return {"world": [list(range(launched.world))], "intra": launched.node_members(),
            "inter": [launched.cross_node_members()]}


@dataclasses.dataclass
class BenchResults:
    context: dict
    ops: list[OpResult]
    contention: dict | None = None  # with --contention (shardwire.bench.contention)


def benchmark(config: BenchConfig, device: torch.device, out: TextIO | None = None) -> BenchResults:
    """Measure every operation of ``config`` on every measured group, in the default process group.

    Every rank calls this and gets all the results; rank 0 prints them to ``out`` as they come.
    Raises ``BenchError`` when the backend cannot run an operation as asked.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    launched = Placement.launched(world, config.ranks_per_node)
    contexts = _contexts(config, launched, device)
    try:
        context = _describe(config, launched, contexts, device)
        show = out is not None and rank == 0

        def say(line: str) -> None:
            if show:
                print(line, file=out, flush=True)

        for line in report.header_lines(context):
            say(line)
        _check_backend(config, launched, contexts, device)

        settings = SweepSettings(warmup=config.warmup, iters=config.iters, blocking=config.blocking,
                                 check=config.check, combine=config.combine)
        sizes = context["settings"]["sizes"]
        results = [
            _measure(OPERATIONS[op], sizes, group, ctx, config, settings, say)
            for group, ctx in contexts.items()
            for op in config.ops
        ]
        if not config.contention:
            return BenchResults(context, results)
        say("#")
        try:
            return BenchResults(context, results, contention.measure(contexts, config.max_bytes, device, say))
        except contention.ContentionError as err:
            raise BenchError(str(err)) from None
    finally:
        for ctx in contexts.values():
            ctx.close()


def _check_backend(config: BenchConfig, launched: Placement, contexts: dict[str, OpContext],
                   device: torch.device) -> None:
    """Raise ``BenchError`` when the backend cannot run one of the operations, found by trying each
    once on the whole world (measured or not), where every rank takes part."""
    everyone = tuple(range(dist.get_world_size()))
    world_ctx = contexts.get("world") or _context(config, dist.group.WORLD, everyone, device,
                                                  launched.ranks_per_node)
    try:
        failure = first_failure([OPERATIONS[op] for op in config.ops], world_ctx)
    finally:
        if "world" not in contexts:
            world_ctx.close()
    if failure is not None:
        raise BenchError(f"{failure}; where the backend lacks it, choose another --dtype or --redop, "
                         f"or leave the operation out of --ops")


def _measure(operation: type[Operation], sizes: list[int], group: str, ctx: OpContext, config: BenchConfig,
             settings: SweepSettings, say: Callable[[str], None]) -> OpResult:
    """Sweep one operation on one group, printing each row as it is measured."""
    result = OpResult(group=group, ranks=ctx.size, op=operation.name, dtype=config.dtype,
                      redop=config.redop if operation.reduces else None,
                      root=config.root if operation.rooted else None, placement=operation.forms[0])
    align = ctx.dtype.itemsize * (ctx.size if operation.split else 1)
    sizes, rounded = aligned_sizes(sizes, align)
    say("#")
    if rounded:
        say(report.rounding_note(align, operation.split, rounded))
    for line in report.table_head(result):
        say(line)
    for row in sweep(operation, [size // ctx.dtype.itemsize for size in sizes], ctx, settings):
        result.rows.append(row)
        say(report.format_row(result, row))
    for line in report.summary_lines(result):
        say(line)
    return result


def _contexts(config: BenchConfig, launched: Placement, device: torch.device) -> dict[str, OpContext]:
    """This rank's view of each measured group, created in the same order on every rank because
    creating one is collective: its process group among all ranks, its communicator among its members."""
    make_group = {"world": lambda _: dist.group.WORLD, "intra": intra_node_group, "inter": inter_node_group}
    contexts = {}
    for name, groups in _members(launched).items():
        if name in config.groups:
            group = make_group[name](launched)
            mine = next((ranks for ranks in groups if dist.get_rank() in ranks), groups[0])
            contexts[name] = _context(config, group, tuple(mine), device, launched.ranks_per_node)
    return contexts


def _context(config: BenchConfig, group: dist.ProcessGroup | None, ranks: tuple[int, ...],
             device: torch.device, ranks_per_node: int) -> OpContext:
    """This rank's view of one group; on its members with ``--impl shardwire``, a communicator that
    ``OpContext.close()`` stops, placing ranks on nodes as the bench does (``--ranks-per-node``)."""
    me = dist.get_rank()
    member = me in ranks
    comm = None
    if member and config.impl == "shardwire":
        comm = Communicator(group, device, timeout=datetime.timedelta(seconds=config.timeout),
                            ranks_per_node=ranks_per_node)
    return OpContext(
        group=group if member else None,
        ranks=ranks,
        rank=ranks.index(me) if member else None,
        device=device,
        dtype=DTYPES[config.dtype],
        redop=config.redop,
        root=config.root,
        comm=comm,
        wire=Wire.parse(config.wire),
    )


def _describe(config: BenchConfig, launched: Placement, contexts: dict[str, OpContext], device: torch.device) -> dict:
    """The run's context for the report's header and JSON: world, machines, versions, settings and the
    command that asked for them."""
    places = [None] * launched.world
    dist.all_gather_object(places, (socket.gethostname(), _device_name(device)))
    members = _members(launched)
    return {
        "world": launched.world,
        "nodes": launched.nodes,
        "ranks_per_node": launched.ranks_per_node,
        "backend": str(dist.get_backend()),
        "devices": dict(collections.Counter(name for _, name in places)),
        "hosts": sorted({host for host, _ in places}),
        "torch": torch.__version__,
        "nccl": _nccl_version(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_TRANSPORT_ENV)},
        "groups": {name: {"ranks": ctx.size, "members": members[name]} for name, ctx in contexts.items()},
        "settings": {
            "ops": config.ops, "dtype": config.dtype, "redop": config.redop, "root": config.root,
            "impl": config.impl, "wire": str(Wire.parse(config.wire)), "warmup": config.warmup,
            "iters": config.iters, "blocking": config.blocking,
            "check": config.check, "combine": config.combine, "sizes": config.sizes(),
        },
        "command": shlex.join(["shardwire", "bench", *config.argv]),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        model = None
    return f"cpu ({model or platform.machine()})"


def _nccl_version() -> str | None:
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
