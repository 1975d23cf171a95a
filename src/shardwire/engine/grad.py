"""What a training loop calls around a sharded model's step: global-norm clipping, accumulation
without reduction, and, for groups that sync every H steps, syncing them now."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from shardwire.engine.shard import engine_of


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of a sharded model so that their global norm is at most ``max_norm``.

    The norm is over the whole model, not this rank's shards: each rank reduces its shards to one
    scalar (``sum |g|^p``, or the max for the inf-norm) and one all-reduce of that scalar over the
    ranks that split the buffers combines them: one group's shards are the whole model (under
    hybrid sharding every group holds the same gradients; when groups sync every H steps, each
    clips its own). The scaling factor stays on the device,
    so there is no host sync. Padding in the flat buffers carries zero gradient and does not change
    the norm. Returns the total norm.
    """
    engine = engine_of(model)
    engine.emit("clip", None, "start")
    total = _clip(engine, model, max_norm, float(norm_type))
    engine.emit("clip", None, "end")
    return total


def _clip(engine, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    # a rank holding no gradient (its slices all padding) still takes part in the all-reduce
    local = (torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=True) if params
             else torch.zeros((), device=engine.device))
    over = engine.layout.shard
    if math.isinf(norm_type):
        over.all_reduce(local, tag="grad norm", op="max").wait()
        total = local
    else:
        powered = local.double() ** norm_type
        over.all_reduce(powered, tag="grad norm").wait()
        total = (powered ** (1.0 / norm_type)).to(local.dtype)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


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


def sync_now(model: nn.Module) -> None:
    """Sync every group's model now, under ``shard(..., sync=...)``: apply the sync in flight, then
    average every fragment's change since its last sync and take the outer step, waiting for each.
    Afterwards every group holds the same model: call it after the last step, before evaluating,
    exporting or saving the result of training. Every rank must call it; without sync it does
    nothing (the groups hold the same model at every step)."""
    engine = engine_of(model)
    if engine.outer is not None:
        engine.outer.sync_now()
