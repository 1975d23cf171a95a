"""``GradScaler``: dynamic loss scaling for fp16 training of a sharded model.

fp16 has the range of neither fp32 nor bf16: small gradients underflow to zero unless the loss is
scaled up before backward and the gradients scaled back down before the optimizer step, skipping
steps whose gradients overflowed. ``torch.amp.GradScaler`` does all of that, but it looks only at the
gradients this rank holds, which for a sharded model are its shards: one rank would find an
overflow and skip the step while the others take it, and the ranks' copies of the model would part.
This scaler decides on every rank that splits the buffers together (every rank, or a hybrid
layout's group, whose gradients are the whole model's), with one all-reduce (max) of the overflow
flag, on the device, so they skip or take each step as one; groups that sync every H steps decide
for their own models, with nothing crossing between them. Use it exactly as torch's::

    scaler = shardwire.GradScaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)               # before clipping, so the norm is of the true gradients
    shardwire.clip_grad_norm_(model, 1.0)
    scaler.step(optimizer)                   # skipped on every rank if any rank's shard overflowed
    scaler.update()

Like torch's, ``step`` reads the overflow flag on the host, once per step: fp16 training pays that
synchronization; bf16 needs no scaler at all.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwire.engine.shard import engine_of


class GradScaler(torch.amp.GradScaler):
    def __init__(self, model: nn.Module, **kwargs):
        """``kwargs`` are ``torch.amp.GradScaler``'s (``init_scale``, ``growth_interval`` ...)."""
        self._comm = engine_of(model).layout.shard
        super().__init__(self._comm.device.type, **kwargs)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        device = self._comm.device
        if device not in found:  # no gradient on this rank: it still takes part in the decision
            found[device] = torch.zeros_like(found_inf, device=device)
        self._comm.all_reduce(found[device], tag="loss scaler overflow", op="max").wait()
        return found
