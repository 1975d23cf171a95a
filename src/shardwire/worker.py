"""Where a worker runs: its device, the backend that moves tensors there, and its process group.

The one home of these choices for every command and for ``shard``: a worker started by torchrun
(one per GPU) uses the GPU of its ``LOCAL_RANK`` with NCCL, one on a machine without CUDA (or told
``gloo``) uses the CPU with gloo. A plain ``python script.py`` gets a world of one, so a single
process needs no distributed set-up at all.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardwire.launch import host_memory_per_worker

BACKENDS = ("auto", "gloo", "nccl")
# The shortest --timeout of shardwire train and bench: the workers meet within it (each imports torch
# first), and ordinary skew between ranks (a checkpoint being written, a first step compiling) is not a hang.
MIN_TIMEOUT_S = 10


def uses_cuda(backend: str) -> bool:
    """Whether ``backend`` ("auto", "gloo" or "nccl") puts the worker on a GPU: "auto" does where
    CUDA is available."""
    return backend == "nccl" or (backend == "auto" and torch.cuda.is_available())


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run on this machine, or None: the error every command gives before
    any worker starts."""
    if backend == "nccl" and not torch.cuda.is_available():
        return "--backend nccl needs CUDA GPUs, and none is visible; use --backend gloo"
    return None


def missing_gpus(backend: str, local_workers: int) -> str | None:
    """Why ``local_workers`` workers on this machine cannot each have a GPU of their own with
    ``backend``, or None: a worker past the last GPU fails to set its device."""
    gpus = torch.cuda.device_count()
    if uses_cuda(backend) and local_workers > gpus:
        return (f"--nproc {local_workers} asks for one GPU per worker, but {gpus} {'is' if gpus == 1 else 'are'} "
                f"visible; use --nproc {gpus} or fewer")
    return None


def memory_per_worker(backend: str, local_workers: int) -> int:
    """The most bytes of data one of ``local_workers`` workers on this machine can hold with
    ``backend``: its GPU's memory (the smallest visible GPU's), or on the CPU its share of the
    machine's (``host_memory_per_worker``). A bound to refuse sizes that can never fit before any
    worker starts, not a promise that less fits: the CUDA context, the allocator and a cgroup's
    limit take their part. Raises ``ValueError`` where the workers alone would not fit."""
    host = host_memory_per_worker(local_workers)
    if uses_cuda(backend):
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return host


def worker_device(backend: str) -> torch.device:
    """This worker's device for ``backend``: the GPU of its ``LOCAL_RANK``, made the current device
    (NCCL would otherwise set itself up on cuda:0 on every rank), or the CPU."""
    if not uses_cuda(backend):
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (on the CPU, work is done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def backend_for(device: torch.device) -> str:
    """The backend torch.distributed uses for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def ensure_initialized(device: torch.device, timeout: datetime.timedelta | None = None) -> None:
    """Initialize the default process group for ``device`` if nobody has.

    Under torchrun (or any launcher that sets ``WORLD_SIZE`` and the rendezvous variables) this joins
    that world; without one, it makes a world of one. On CUDA the group is bound to ``device``
    (``device_id``), which also becomes the current device.
    """
    if dist.is_initialized():
        return
    kwargs = {} if timeout is None else {"timeout": timeout}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend_for(device), **kwargs)
    else:
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1, **kwargs)


@contextlib.contextmanager
def process_group(device: torch.device, timeout: datetime.timedelta) -> Iterator[None]:
    """The default process group for a command's worker, ended when the block ends, however it ends."""
    ensure_initialized(device, timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
