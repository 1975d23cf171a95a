"""What a training loop calls around a sharded model's step: global-norm clipping, accumulation
without reduction, and, for groups that sync every H steps (DiLoCo), syncing them now or evaluating
the model they agree on."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from shardwire.comm.errors import collective_failed, failed_collective
from shardwire.engine.shard import engine_of
from shardwire.mappings import shown
from shardwire.renamed import warn_renamed


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)``, timed as the
    profiler's clip phase; kept for scripts written before a sharded model's parameters were DTensors.

    torch's own call is right on a sharded model, as under FSDP2: the gradients are DTensors, so the
    norm is over the whole model, not this rank's rows. Each rank reduces its rows to one scalar and
    DTensor sums those over the ranks that split the parameters: one group's rows are the whole model
    (under hybrid sharding every group holds the same gradients; when groups sync every H steps, each
    clips its own). Padding carries no gradient. Returns the total norm, a DTensor replicated on
    every rank (``.item()`` and ``.full_tensor()`` both give it).

    The infinity norm is taken here: torch's takes the largest value of each rank's rows, and a rank
    that holds none of a parameter's rows (one smaller than the ranks) has no largest value, so
    torch's own call fails there; use this one for the infinity norm.
    """
    engine = engine_of(model)
    try:  # as torch reads it: 'inf', a numpy number, a 0-dim tensor
        order = float(norm_type)
    except (TypeError, ValueError):
        order = math.nan
    if not order >= 0:  # torch takes a negative order, which no norm has and which each rank's empty rows fail
        raise ValueError(f"norm_type must be a norm's order, 0 or more (2.0, or math.inf for the largest value), "
                         f"got {shown(norm_type)}")
    engine.emit("clip", None, "start")
    try:
        if order == math.inf:
            total = _largest_gradient(list(model.parameters()))
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
        else:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, order)
    except RuntimeError as err:  # DTensor's all-reduce of the norm: a peer that stopped fails it here
        if not (failed_collective(err) and dist.is_initialized() and dist.get_world_size() > 1):
            raise
        raise collective_failed(err, "the gradient norm's all-reduce") from err
    engine.emit("clip", None, "end")
    return total


def _largest_gradient(params: list[nn.Parameter]) -> torch.Tensor:
    """The largest absolute value of the gradients: each rank's of its rows (0 where it holds none),
    then the largest over the ranks that split the parameters, as DTensor reduces a partial max over
    the mesh dimensions a split gradient is sharded on (a 0-dim one, held whole, is on none)."""
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    local = torch.stack([g.to_local().abs().max().float() if g.to_local().numel() else
                         g.to_local().new_zeros((), dtype=torch.float32) for g in grads]).max()
    split = next((g for g in grads if any(placement.is_shard() for placement in g.placements)), grads[0])
    mesh, placements = split.device_mesh, split.placements
    partial = [Partial("max") if placement.is_shard() else placement for placement in placements]
    return DTensor.from_local(local, mesh, partial).redistribute(mesh, [Replicate()] * len(placements))


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them, for gradient accumulation.

    Backward passes inside the block keep each unit's unsharded gradient (summed over the passes)
    instead of reduce-scattering it; the next backward outside the block adds its own and reduces
    the total once. This trades memory (one unsharded gradient per unit) for fewer collectives.
    """
    engine = engine_of(model)
    previous, engine.sync_gradients = engine.sync_gradients, False
    try:
        yield
    finally:
        engine.sync_gradients = previous


def diloco_sync(model: nn.Module) -> None:
    """Sync every group's model now, under ``shard(..., diloco=...)``: apply the sync in flight, then
    average every fragment's change since its last sync and take the outer step, waiting for each.
    Afterwards every group holds the same model: call it after the last step, before evaluating,
    exporting or saving the result of training. Every rank must call it; without DiLoCo it does
    nothing (the groups hold the same model at every step)."""
    engine = engine_of(model)
    if engine.outer is not None:
        engine.outer.sync_now()


def sync_now(model: nn.Module) -> None:
    """``diloco_sync`` under its name before the rename, which read as the opposite of ``no_sync``:
    warns, then syncs."""
    warn_renamed("shardwire.sync_now is renamed shardwire.diloco_sync")
    diloco_sync(model)


@contextlib.contextmanager
def global_model(model: nn.Module) -> Iterator[None]:
    """Hold, while the block runs, the model the groups agree on under ``shard(..., diloco=...)``: the
    anchor of their last sync (the sync due after the last step taken first), as DiLoCo evaluates
    it; each group gets its own back after the block. Every rank must enter it, at a step's end.
    Without DiLoCo the groups hold the same model at every step, and it changes nothing."""
    engine = engine_of(model)
    with engine.outer.global_model() if engine.outer is not None else contextlib.nullcontext():
        yield
