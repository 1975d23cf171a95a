"""One rank of a large world in this one process, with torch's fake process group: what the CPU
tests (``test_large_world``) and the CUDA suite (``gpu/test_large_world_cuda``) both run.

A fake group (backend ``fake``) completes each collective at once, in this process: so the engine runs
as any rank of any world, on the CPU or on one GPU, and every path that depends on the rank and the
world (shard sizes, group membership, the quantized reductions' per-node sums, the order check, the
CUDA side streams) runs as on that rank of a real job. The collectives carry this rank's own data
(an all-gather fills every rank's slot with this rank's input), so the values trained mean nothing:
the tests look at what ran, what it issued, what the host did and what memory it held.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

from harness import peak_allocated
import shardwire
from shardwire.comm import communicator, levels
from shardwire.comm.wire import Wire
from shardwire.engine.shard import engine_of
from shardwire.models.gpt import GPT, Block, GPTConfig, loss_fn
from shardwire.sim.architecture import architecture
from shardwire.sim.memory import MemoryEstimate, estimate_memory
from shardwire.sim.specs import ClusterSpec, LinkSpec, TrainingSpec

# (ranks, ranks per node): 4 and 8 nodes, so that both worlds run every path of several nodes the
# same way (with 2 nodes a quantized reduction receives one row, which needs no copy to be contiguous)
WORLDS = ((8, 2), (64, 8))
LAYOUTS = ("full", "hybrid", "hybrid_secondary")
WIRES = (None, "params=int8,grads=int4")
MIXED_PRECISION = "bf16"
STEPS = 3  # the first records the order of units; the last is measured
# PRESETS["tiny"] with a vocabulary that leaves the root's buffer padded at 64 ranks, on the last of them
MODEL = GPTConfig(vocab_size=255, seq_len=32, layers=3, hidden=32, heads=2)

# A model whose step's peak is mostly activations, as a large model's is, in 32 blocks, so that the
# memory model's allowance for the working memory of one block's backward is 1/32 of what they keep.
MEMORY_MODEL = GPTConfig(vocab_size=256, seq_len=128, layers=32, hidden=32, heads=2)
MEMORY_BATCH = 8

# (ranks, ranks per node, rank): the first and the last rank of each world
CASES = [(world, per_node, rank) for world, per_node in WORLDS for rank in (0, world - 1)]


@contextlib.contextmanager
def fake_world(world: int, per_node: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of a fake world of ``world`` ranks, ``per_node`` to a node
    (torchrun's ``LOCAL_WORLD_SIZE``, by which hybrid layouts form their groups), for the block.

    A default group made before (a world of one that a test's ``shard`` call joined) is ended
    first. One intra-op thread: a step of these models is many small kernels, and on a shared
    machine threads that wait for each other take longer than the kernels. DTensor caches how it
    runs an operation by mesh, and a mesh is told by its ranks, not its groups: the next fake world
    would find this one's groups, ended, in the cache, so it is cleared as each world starts and ends."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()  # what earlier tests' worlds left there changes its lookups' work
    saved_env, saved_threads = os.environ.get("LOCAL_WORLD_SIZE"), torch.get_num_threads()
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with _outputs_carry_data():
            yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved_env


@contextlib.contextmanager
def _outputs_carry_data() -> Iterator[None]:
    """Make the fake group's reduce-scatters and all-to-alls write their outputs (this rank's own
    data), where this torch's fake group leaves them as they were (torch 2.11 does): the engine would
    otherwise train on whatever the memory held, NaN included. The values mean nothing either way;
    they only stay finite."""
    probe = torch.full((1,), math.nan)
    communicator.torch_reduce_scatter(probe, torch.zeros(dist.get_world_size()), group=dist.group.WORLD)
    if not probe.isnan().item():
        yield
        return

    def reduce_scatter(collective: Callable) -> Callable:
        @functools.wraps(collective)
        def call(output, full, *args, group, **kwargs):
            work = collective(output, full, *args, group=group, **kwargs)
            output.copy_(full.view(-1, output.numel())[dist.get_rank(group)].view_as(output))
            return work
        return call

    def all_to_all(output, given, *args, group, **kwargs):
        work = dist_all_to_all(output, given, *args, group=group, **kwargs)
        output.copy_(given.view_as(output))
        return work

    dist_all_to_all = dist.all_to_all_single
    with contextlib.ExitStack() as stack:
        for module, name in ((communicator, "torch_reduce_scatter"), (levels, "_torch_reduce_scatter")):
            stack.enter_context(mock.patch.object(module, name, reduce_scatter(getattr(module, name))))
        stack.enter_context(mock.patch.object(dist, "all_to_all_single", all_to_all))
        yield


@dataclasses.dataclass
class Training:
    """A GPT sharded on this rank of the fake world, its optimizer and a batch to train on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokens: torch.Tensor

    @classmethod
    def start(cls, device: torch.device, layout: str, wire: str | None, *, config: GPTConfig = MODEL,
              batch: int = 2, diloco: str | None = None) -> Training:
        torch.manual_seed(0)
        model = shardwire.shard(GPT(config).to(device), units=[Block], layout=layout, wire=wire,
                                mixed_precision=MIXED_PRECISION, diloco=diloco)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        return cls(model, optimizer, tokens.to(device))

    @property
    def engine(self):
        return engine_of(self.model)

    def step(self) -> torch.Tensor:
        """One training step, clipping included (one more collective); the loss."""
        loss = loss_fn(self.model(self.tokens[:, :-1]), self.tokens[:, 1:])
        loss.backward()
        shardwire.clip_grad_norm_(self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def state_nbytes(self) -> int:
        """What the engine keeps between steps: the shards (the fp32 masters), the optimizer's
        state (this rank's part of each DTensor) and the error-feedback residuals."""
        flats = self.engine.flats
        kept = [*(flat.shard for flat in flats), *(r for flat in flats for r in flat.residuals.values()),
                *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
        return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in kept)


# ------------------------------------------------------------------ the collectives torch ran


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a torch collective: which, its group's ranks, its input's dtype, the elements of
    its tensors (output first), and an all-to-all's split sizes."""

    op: str
    ranks: tuple[int, ...]
    dtype: torch.dtype
    numels: tuple[int, ...]
    splits: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[str, tuple[int, ...], torch.dtype]:
        return self.op, self.ranks, self.dtype


# The torch collectives of a training step, under the names the transport calls them by.
TORCH_COLLECTIVES = (
    (communicator, "torch_all_gather", "all_gather"),
    (communicator, "torch_reduce_scatter", "reduce_scatter"),
    (levels, "_torch_reduce_scatter", "reduce_scatter"),
    (dist, "all_to_all_single", "all_to_all"),
    (dist, "all_reduce", "all_reduce"),
)


@contextlib.contextmanager
def torch_collectives() -> Iterator[list[Call]]:
    """Every call of a torch collective inside the block, from any thread (on the CPU a quantized
    collective runs on its communicator's lane), in the order they were made."""
    calls: list[Call] = []

    def spying(op: str, collective: Callable) -> Callable:
        @functools.wraps(collective)
        def call(*args, group, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            splits = next((tuple(a) for a in args if isinstance(a, list)), ())
            calls.append(Call(op, tuple(dist.get_process_group_ranks(group)), tensors[-1].dtype,
                              tuple(t.numel() for t in tensors), splits))
            return collective(*args, group=group, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for module, name, op in TORCH_COLLECTIVES:
            stack.enter_context(mock.patch.object(module, name, spying(op, getattr(module, name))))
        yield calls


@dataclasses.dataclass(frozen=True)
class Groups:
    """The ranks of this rank's groups in a world placed node by node: everyone, this rank's node,
    and the ranks at its position on every node."""

    everyone: tuple[int, ...]
    node: tuple[int, ...]
    position: tuple[int, ...]

    @classmethod
    def of(cls, world: int, per_node: int, rank: int) -> Groups:
        everyone = tuple(range(world))
        first = rank - rank % per_node
        return cls(everyone, everyone[first:first + per_node], everyone[rank % per_node::per_node])


def expected_calls(layout: str, wire: Wire, groups: Groups, units: int) -> collections.Counter:
    """The torch collectives of a step after the first, by (op, ranks, dtype), for a model of
    ``units`` units of one buffer each (the root and the blocks), as ``shardwire.engine.layout`` and
    ``shardwire.comm.wire`` describe them: hybrid groups are nodes, and only groups that span nodes
    quantize."""
    everyone, node, position = groups.everyone, groups.node, groups.position
    compute, reduce = torch.bfloat16, torch.float32
    shard = node if layout == "hybrid" else everyone
    backward = everyone if layout == "full" else node  # hybrid_secondary gathers from the secondary shards
    communicators = {"full": [everyone], "hybrid": [everyone, node, position],
                     "hybrid_secondary": [everyone, node]}[layout]
    calls: collections.Counter = collections.Counter()

    def gathered(group):  # the dtype a gather over ``group`` carries
        return torch.uint8 if wire.params is not None and group != node else compute

    calls["all_gather", shard, gathered(shard)] += units  # forward: every unit
    # backward: the root stays gathered, and so do the last two blocks, which backward opens with
    calls["all_gather", backward, gathered(backward)] += units - 3
    if layout == "hybrid":
        calls["reduce_scatter", node, reduce] += units
        if wire.grads is None:
            calls["all_reduce", position, reduce] += units
        else:  # the quantized all-reduce: partial sums to their owners, then the sums gathered
            calls["all_to_all", position, torch.uint8] += units
            calls["all_gather", position, torch.uint8] += units
    elif wire.grads is None:
        calls["reduce_scatter", everyone, reduce] += units
    else:  # the node's exact sums, then each sent quantized to the node of the rank that owns it
        calls["reduce_scatter", node, reduce] += units
        calls["all_to_all", position, torch.uint8] += units
    # (the gradients' norm is DTensor's, a functional collective over the shard group, not one of these)
    for group in communicators:
        calls["all_gather", group, torch.int64] += 1  # the order check
    return calls


def check_rank_dependent_paths(device: torch.device, world: int, per_node: int, rank: int, layout: str,
                               wire: str | None) -> None:
    """A few steps as ``rank`` of ``world``: its groups, its shards, and the torch collectives of a
    step, with the shapes of the quantized reductions' per-node sums."""
    groups, parsed = Groups.of(world, per_node, rank), Wire.parse(wire)
    with fake_world(world, per_node, rank):
        training = Training.start(device, layout, wire)
        for _ in range(STEPS - 1):
            training.step()
        with torch_collectives() as calls:
            assert torch.isfinite(training.step())
        engine = training.engine
        roles = {role: getattr(engine.layout, role) for role in ("world", "shard", "replicate", "secondary")}
        members = {role: comm and tuple(dist.get_process_group_ranks(comm.group)) for role, comm in roles.items()}
    assert members == {
        "world": groups.everyone,
        "shard": groups.node if layout == "hybrid" else groups.everyone,
        "replicate": groups.position if layout == "hybrid" else None,
        "secondary": groups.node if layout == "hybrid_secondary" else None,
    }
    shard = engine.layout.shard
    for flat in engine.flats:
        packing = flat.packing
        assert flat.shard.numel() * shard.world == packing.padded_numel
        assert flat.shard_range[0] == shard.rank * flat.shard.numel()
        # each parameter a DTensor of its whole shape over this rank's rows, as DTensor computes them
        for slot, param, held in flat.held_parts():
            assert param.shape == slot.shape and param.to_local().numel() == held.numel
            assert param.to_local().shape == packing.local_shape(slot, shard.rank)

    units = len(engine.flats)
    assert units == len(engine.units) + 1
    assert collections.Counter(call.key for call in calls) == expected_calls(layout, parsed, groups, units)

    codec = parsed.grad_codec
    if codec is None:
        return
    nodes = world // per_node
    if layout == "hybrid":  # each shard is all-reduced over one rank per node, in slots of a node each
        slots = [math.ceil(flat.shard.numel() / nodes) for flat in engine.flats]
    else:
        slots = [flat.packing.padded_numel // world for flat in engine.flats]
        within = [call.numels for call in calls if call.op == "reduce_scatter"]
        assert sorted(within) == sorted((nodes * slot, world * slot) for slot in slots)
    for call in calls:
        if call.op == "all_to_all":
            assert call.ranks == groups.position
            me, row = call.ranks.index(rank), call.numels[0] // (nodes - 1)
            assert call.splits == tuple(0 if n == me else row for n in range(nodes))
    rows = [call.numels[0] // (nodes - 1) for call in calls if call.op == "all_to_all"]
    assert sorted(rows) == sorted(codec.packed_numel(slot) for slot in slots)


# ---------------------------------------------------------------------- the host's work per step


def host_work(fn: Callable[[], object]) -> collections.Counter:
    """What the host does in ``fn()``, on every thread, counted by name: each call of a Python function
    of shardwire's or torch's, and each torch operator called from outside torch's operators. What
    an operator runs inside is its own affair: it depends on the shapes (a pad by nothing is a copy),
    and inside a collective it is the backend's (a fake one copies this rank's input into every
    rank's slot, a loop over the world that a real backend leaves to the network).

    Counts, not times: they are the same on every run and every machine, so a test can compare two
    worlds exactly; the times are ``benchmarks/large_world.py``'s. Not counted: torch's equality
    tests (``__eq__``, and what they call), which are what a lookup in one of its caches (DTensor's
    sharding propagation) runs on each key of the same hash: how many depends on what else the
    cache holds, not on the step's work."""
    # every thread: the training thread, CUDA's autograd thread, the lanes of the CPU's quantized collectives
    with profile(activities=[ProfilerActivity.CPU], with_stack=True,
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as profiled:
        fn()
    roots = profiled.profiler.kineto_results.experimental_event_tree()
    # A frame still running when the profiler stopped is one the work ran inside (the caller, a
    # lane's loop, however many lanes earlier models left), not a call it made.
    stopped = max(root.end_time_ns for root in roots)
    work: collections.Counter = collections.Counter()

    def count(event, in_operator: bool) -> None:
        kind = event.tag.name
        if kind == "PyCall" and event.name.startswith("torch/") and event.name.endswith(": __eq__"):
            return
        if kind == "PyCall" and event.name.startswith(("shardwire/", "torch/")) and event.end_time_ns < stopped:
            work[event.name] += 1
        elif kind == "TorchOp" and not in_operator:
            work[event.name] += 1
            in_operator = True
        for child in event.children:
            count(child, in_operator)

    for root in roots:
        count(root, False)
    return work


def check_host_work_does_not_grow(device: torch.device, layout: str, wire: str | None, *, last: bool) -> None:
    """The same collectives, and no Python call or torch operator more often, in a step as the first
    (or the last) rank of 64 ranks on 8 nodes as of 8 ranks on 4: nothing the engine does per step
    loops over the world. (The last rank of 64 may do less: its optimizer skips the parameters its
    slice misses.)"""
    measured = {}
    for world, per_node in WORLDS:
        with fake_world(world, per_node, world - 1 if last else 0):
            training = Training.start(device, layout, wire)
            training.step()  # records the order
            with _gpu_held_back(device):
                training.step()  # leaves its order checks to be read by the next, as every later step does
            with training.engine.record() as records, _gpu_held_back(device):
                work = host_work(training.step)
        measured[world] = collections.Counter((record.op, record.tag) for record in records), work
    (collectives, work), (collectives_large, work_large) = (measured[world] for world, _ in WORLDS)
    assert collectives_large == collectives
    more = {name: (work[name], count) for name, count in work_large.items() if count > work[name]}
    assert not more, f"done more often per step in the larger world (smaller, larger): {more}"


@contextlib.contextmanager
def _gpu_held_back(device: torch.device) -> Iterator[None]:
    """On CUDA, the block runs with the GPU idle at its start and held back until its end (a sleep
    queued first, many times a step's host work), so that what the host reads once an event has
    passed (the order checks' results) is the same at every run: the step before's, at the first
    forward, and none of its own."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda._sleep(1_000_000_000)  # half a second at 2 GHz
    yield
    torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- memory per rank


def peak_nbytes(training: Training) -> int:
    """The bytes this rank holds at the peak of a step after the first: what the step allocates at
    its peak, beyond what it started with, plus the engine's state at its start (``state_nbytes``),
    so that what else the process holds (the batch, cuBLAS's workspace) is not counted.

    Bytes as tensors asked for them: on CUDA ``requested_bytes``, which, unlike
    ``max_memory_allocated``, leaves out the caching allocator's rounding, which the memory model
    leaves to its usable fraction; on the CPU the profiler's record of the training thread's
    allocations (it records no other thread's: the temporaries of quantized collectives, which run
    on lanes there, are not seen), and a ``Pending`` holds no tensors there, so the CPU's peak is
    at most a GPU's."""
    for _ in range(STEPS - 1):
        training.step()
    state = training.state_nbytes()
    device = training.tokens.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_stats(device)["requested_bytes.all.current"]
        torch.cuda.reset_peak_memory_stats(device)
        training.step()
        torch.cuda.synchronize(device)
        return state + torch.cuda.memory_stats(device)["requested_bytes.all.peak"] - start
    return state + peak_allocated(training.step)


def memory_model(world: int, per_node: int, layout: str, wire: str | None, *, diloco: str = "none",
                 fault_tolerance: bool = False) -> MemoryEstimate:
    """What ``shardwire.sim.memory`` says a rank holds at the peak of ``MEMORY_MODEL``'s step."""
    link = LinkSpec(busbw_GBps=1.0)  # the memory model reads the cluster's shape, not its speeds
    cluster = ClusterSpec(nodes=world // per_node, gpus_per_node=per_node, peak_tflops=1.0, gpu_memory_gb=80.0,
                          intra_node=link, inter_node=link)
    training = TrainingSpec(micro_batch=MEMORY_BATCH, layout=layout, wire=str(Wire.parse(wire)),
                            precision=MIXED_PRECISION, reduce_precision="fp32", diloco=diloco,
                            fault_tolerance=fault_tolerance)
    return estimate_memory(architecture(MEMORY_MODEL.spec(), training.compute_bytes), cluster, training)


def check_memory_against_model(device: torch.device, world: int, per_node: int, rank: int, layout: str,
                               wire: str | None) -> None:
    """This rank's peak bytes in a step of ``MEMORY_MODEL`` are within 5% of the memory model's."""
    with fake_world(world, per_node, rank):
        training = Training.start(device, layout, wire, config=MEMORY_MODEL, batch=MEMORY_BATCH)
        measured = peak_nbytes(training)
    estimate = memory_model(world, per_node, layout, wire)
    assert abs(measured / estimate.total - 1) <= 0.05, (measured, estimate)
