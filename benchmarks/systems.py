"""The training systems the benchmarks compare, each wrapping the same GPT the way its users would.

shardwire and PyTorch FSDP2 (``fully_shard``) shard the same units (the transformer blocks, plus the
root) with the same reshard policy; DDP replicates the model and all-reduces gradients. Each
layout is a system of its own: shardwire's ``full``, ``hybrid`` and ``hybrid_secondary`` and FSDP2's
full sharding and HSDP (a 2-D device mesh), the hybrid ones in groups of a node's ranks
(``shardwire.placement.launch_ranks_per_node``: torchrun's ``LOCAL_WORLD_SIZE``, or SLURM's tasks per
node); so is each of shardwire's quantized wires (``full``, and ``hybrid`` with int8/int4), and
``hybrid`` syncing every H steps at the sync's defaults.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import shardwire
from shardwire.comm.communicator import Pending
from shardwire.comm.records import CommRecord
from shardwire.comm.wire import Wire
from shardwire.engine.shard import engine_of
from shardwire.models import fp8 as float8
from shardwire.models.gpt import Block, GPTConfig, loss_fn
from shardwire.placement import launch_ranks_per_node


class Setup(NamedTuple):
    """A shardwire system: its layout, its wire, and its DiLoCo, syncing every H steps (None: synchronous)."""

    layout: str
    wire: str
    diloco: str | None = None


SHARDWIRE_SYSTEMS = {
    "shardwire": Setup("full", "none"),
    "shardwire-hybrid": Setup("hybrid", "none"),
    "shardwire-hybrid_secondary": Setup("hybrid_secondary", "none"),
    "shardwire-int8": Setup("full", "int8"),
    "shardwire-int8-int4": Setup("full", "params=int8,grads=int4"),
    "shardwire-hybrid-int8-int4": Setup("hybrid", "params=int8,grads=int4"),
    "shardwire-sync": Setup("hybrid", "none", "sync_every=20,fragments=4"),  # the sync's defaults
}
SYSTEMS = (*SHARDWIRE_SYSTEMS, "fsdp2", "fsdp2-hsdp", "ddp")


def wrap(system: str, model: nn.Module, *, reshard: bool = True, prefetch: int = 2,
         compute_dtype: torch.dtype | None = None, compile: bool = False, fp8: bool = False) -> nn.Module:
    """``model`` as ``system`` trains it. ``compute_dtype`` (the sharded systems): units compute in it
    and reduce gradients in fp32, the master weights staying in the model's own dtype. ``compile``:
    each block compiled, as torchtitan compiles them (shardwire: ``shard(compile=True)``; otherwise
    each block replaced by its ``torch.compile``'d module before it is sharded). ``fp8``: the blocks'
    linear layers converted to torchao's float8 training before sharding (FSDP2 gathering them in
    fp8, as torchtitan runs it; shardwire gathers the compute dtype)."""
    fsdp = system in ("fsdp2", "fsdp2-hsdp")
    if fp8:
        float8.convert(model, [Block], enable_fsdp_float8_all_gather=fsdp)
    if system in SHARDWIRE_SYSTEMS:
        setup = SHARDWIRE_SYSTEMS[system]
        precision = shardwire.MixedPrecision(compute_dtype, torch.float32) if compute_dtype else None
        synced = {} if setup.diloco is None else {"diloco": setup.diloco}  # as an earlier shardwire is called too
        return shardwire.shard(model, units=[Block], reshard_after_forward=reshard, prefetch=prefetch,
                               layout=setup.layout, wire=setup.wire, mixed_precision=precision, compile=compile,
                               **synced)
    if compile:
        compile_blocks(model)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = next(model.parameters()).device
        world = dist.get_world_size()
        per_node = launch_ranks_per_node(world)  # shardwire's hybrid groups
        if system == "fsdp2-hsdp":
            mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                      reduce_dtype=torch.float32 if compute_dtype else None)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    if system == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def compile_blocks(model: nn.Module) -> None:
    """Replace each block of ``model`` by its compiled module (torchtitan's per-block compile): a
    wrapper applied after it sees its hooks outside the compiled graph."""
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, fullgraph=True)


def clip(system: str | None, model: nn.Module, max_norm: float) -> torch.Tensor:
    if system in SHARDWIRE_SYSTEMS:
        return shardwire.clip_grad_norm_(model, max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


class TrainingStep:
    """The step every benchmark times: a batch of random tokens (drawn per rank, on the model's
    device), forward, backward, gradient clipping to norm 1 and AdamW. ``system`` None: ``model`` is
    a bare, unwrapped GPT; ``autocast``: its forward and loss run under torch's autocast to that dtype
    (the usual mixed precision of an unsharded model: fp32 weights, cast for each matmul).
    ``fused``: AdamW's single-kernel implementation, as ``shardwire train`` and torchtitan run it (False:
    torch's default, which on the CPU loops over the parameters, a dispatch per operation each)."""

    def __init__(self, system: str | None, model: nn.Module, config: GPTConfig, batch: int,
                 autocast: torch.dtype | None = None, fused: bool = True):
        self.system = system
        self.model = model
        self.config = config
        self.batch = batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(self._device).manual_seed(dist.get_rank())
        self._autocast = autocast

    def __call__(self) -> None:
        tokens = torch.randint(0, self.config.vocab_size, (self.batch, self.config.seq_len + 1),
                               generator=self._generator, device=self._device)
        with torch.autocast(self._device.type, self._autocast, enabled=self._autocast is not None):
            loss = loss_fn(self.model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        clip(self.system, self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class StepCollectives:
    """The collectives of one training step, recorded while it runs and replayed on their own: the
    step's communication without its computation.

    Each system is recorded where it issues them: shardwire through its own records, FSDP2 by wrapping
    the ``torch.distributed`` functions it calls, DDP with a communication hook (its reducer calls the
    process group from C++, out of Python's sight). ``replay`` issues every recorded collective at
    once, in the recorded order, on zeroed buffers of the recorded sizes (zeros: sums of garbage could
    hit slow denormals), so the backend overlaps them all it can, and waits for all of them. Not seen:
    the scalar all-reduce of FSDP2's gradient norm, which goes through functional collectives.
    """

    _TORCH_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                          "reduce_scatter_tensor", "all_reduce")

    def __init__(self, system: str, model: nn.Module):
        self.system = system
        self.model = model
        self._replays: list[Callable[[], object]] = []
        self._recording = False
        if system == "ddp":  # a hook must be in place before the first backward
            model.register_comm_hook(None, self._ddp_hook)

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Record the collectives issued inside the block (one step), replacing any earlier record."""
        self._replays = []
        self._recording = True
        try:
            if self.system in SHARDWIRE_SYSTEMS:
                with contextlib.ExitStack() as stack:
                    comms = engine_of(self.model).layout.communicators
                    recorded = [(comm, stack.enter_context(comm.record())) for comm in comms]
                    yield
                self._replays = [self._shardwire_replay(comm, record) for comm, records in recorded
                                 for record in records]
            elif self.system in ("fsdp2", "fsdp2-hsdp"):
                with self._torch_collectives_recorded():
                    yield
            else:
                yield
        finally:
            self._recording = False

    def replay(self) -> None:
        works = [issue() for issue in self._replays]
        for work in works:
            work.wait()

    def _shardwire_replay(self, comm, record: CommRecord) -> Callable[[], Pending]:
        # Records carry sizes, not dtypes: replay in fp32, the dtype these benchmarks train in, on the
        # system's wire (a quantized record is one whose bytes as sent differ from its size).
        share = -(-record.nbytes // (4 * comm.world))
        full, shard = torch.zeros(share * comm.world), torch.zeros(share)
        setup = SHARDWIRE_SYSTEMS[self.system]
        wire = Wire.parse(setup.wire) if record.wire_nbytes != record.nbytes else Wire()
        if record.op == "all_gather":
            return lambda: comm.all_gather(full, shard, tag=record.tag, codec=wire.param_codec)
        if record.op == "reduce_scatter":
            return lambda: comm.reduce_scatter(shard, full, tag=record.tag, average=True, codec=wire.grad_codec)
        # an all-reduce between groups: of a gradient shard (hybrid), or of a sync's change
        codec = None
        if record.wire_nbytes != record.nbytes:
            if record.tag.endswith("(sync)"):
                from shardwire.engine.diloco import DiLoCo  # only where it syncs: ab_commits.sh races earlier ones

                codec = DiLoCo.parse(setup.diloco).codec
            else:
                codec = wire.grad_codec
        full = torch.zeros(-(-record.nbytes // 4))
        return lambda: comm.all_reduce(full, tag=record.tag, op="avg", codec=codec)

    @contextlib.contextmanager
    def _torch_collectives_recorded(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in self._TORCH_COLLECTIVES if hasattr(dist, name)}
        for name, function in originals.items():
            setattr(dist, name, functools.partial(self._record_torch_call, function))
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)

    def _record_torch_call(self, function, *args, **kwargs):
        def fresh(value):
            return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value

        replay_args = [fresh(value) for value in args]
        replay_kwargs = {key: fresh(value) for key, value in kwargs.items()} | {"async_op": True}
        self._replays.append(lambda: function(*replay_args, **replay_kwargs))
        return function(*args, **kwargs)

    def _ddp_hook(self, state, bucket):  # unannotated: DDP rejects annotations as strings
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        if self._recording:
            buffer = torch.zeros_like(bucket.buffer())
            self._replays.append(lambda: dist.all_reduce(buffer, async_op=True))
        return allreduce_hook(state, bucket)
