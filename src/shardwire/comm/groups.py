"""Process groups: joining the launcher's world, or making a one-process world when there is none."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """The backend torch.distributed uses for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def ensure_initialized(device: torch.device, timeout: datetime.timedelta | None = None) -> None:
    """Initialize the default process group if nobody has.

    Under torchrun (or any launcher that sets ``WORLD_SIZE`` and the rendezvous variables) this joins
    that world; a plain ``python script.py`` gets a world of one, so single-process runs need no
    distributed set-up at all.
    """
    if dist.is_initialized():
        return
    backend = backend_for(device)
    kwargs = {} if timeout is None else {"timeout": timeout}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def check_backend_serves(group: dist.ProcessGroup, device: torch.device) -> None:
    """Fail early, with advice, when the group's backend cannot move tensors on ``device``."""
    backend = str(dist.get_backend(group))
    if device.type == "cpu" and backend == "nccl":
        raise ValueError(
            "the process group uses NCCL, which only moves CUDA tensors, but the model is on the "
            "CPU: move the model to its GPU (model.to(f'cuda:{local_rank}')) or use the gloo backend"
        )
    if device.type == "cuda" and backend == "gloo":
        raise ValueError(
            "the process group uses gloo but the model is on CUDA: initialize it with "
            "backend='nccl' (or 'cpu:gloo,cuda:nccl')"
        )
