"""Pretrained Hugging Face weights read into a sharded model by the slice.

A ``save_pretrained`` directory of safetensors (one file, or several with
``model.safetensors.index.json``) is read through DCP's ``HuggingFaceStorageReader``, as torchtitan
reads it: the sharded model's state dict names each rank's rows of each parameter (DTensors), and
DCP reads only those from the files, straight into the shards. So no worker holds the pretrained
model whole at any time, as ``from_pretrained`` on every worker would.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardwire.engine.shard import engine_of

# The weights read by the slice: what from_pretrained reads first where a directory holds it.
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


def reads_by_slice(directory: pathlib.Path) -> bool:
    """Whether ``directory``'s weights are safetensors, which can be read by the slice."""
    return any((directory / name).exists() for name in SAFETENSORS)


def load_pretrained(model: nn.Module, directory: pathlib.Path) -> None:
    """Fill the sharded ``model``'s parameters (and the buffers the files hold) from ``directory``.

    Every parameter must be in the files with its shape, except a tied one whose other name is
    (``save_pretrained`` writes a tied head once); a buffer the files lack keeps its initial value,
    as ``from_pretrained`` leaves it. What the files hold beyond the model is not read, and named
    (rank 0, on standard error), as ``from_pretrained`` names it. Every rank must call it (``dcp.load``
    is collective); a value read that is not finite is refused on every rank alike, naming its
    tensor: trained on, it would be blamed on the learning rate, or exported."""
    reader = HuggingFaceStorageReader(str(directory))
    stored = {key: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata)}
    names = _names_of_each_parameter(model)
    state = model.state_dict()
    if unused := sorted(key for key in stored if key not in state and key not in names):
        if not dist.is_initialized() or dist.get_rank() == 0:
            shown_keys = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
            print(f"note: {directory}'s weights hold {len(unused)} tensor(s) the model its config.json builds has no "
                  f"place for, which are not read: {shown_keys}", file=sys.stderr, flush=True)
    for key, value in state.items():
        if key in stored and tuple(stored[key].size) != tuple(value.shape):
            raise ValueError(f"{directory}: {key!r} is {tuple(stored[key].size)} in the weights but "
                             f"{tuple(value.shape)} in the model its config.json builds: the weights are another "
                             f"model's, or config.json was changed after they were saved")
        if key not in stored and key in names and not any(name in stored for name in names[key]):
            if unused:  # the same weights under other names: a layout transformers converts as it loads it
                raise ValueError(f"{directory}: the weights have no {key!r}, which the model its config.json builds "
                                 f"has, and hold {len(unused)} tensor(s) it has no place for ({unused[0]!r}...): "
                                 f"stored in a layout transformers converts as from_pretrained loads them (a mixture "
                                 f"of experts' weights by expert), which shardwire does not read, or another "
                                 f"model's, or saved in part; train from the config alone, or convert the weights to "
                                 f"the model's names")
            raise ValueError(f"{directory}: the weights have no {key!r}, which the model its config.json builds "
                             f"has: the weights are another model's, or were saved in part")
    read = {key: value for key, value in state.items() if key in stored}
    dcp.load(read, storage_reader=reader)  # in place: no load_state_dict tells the engine
    engine_of(model).weights_loaded()
    if (key := _not_finite(read)) is not None:
        raise ValueError(f"{directory}: the weights' {key!r} holds values that are not finite: the weights are "
                         f"damaged, or were saved from a run that diverged")


def _not_finite(read: dict[str, torch.Tensor]) -> str | None:
    """The first of ``read`` (in order of name) whose values on any rank are not all finite, the same
    on every rank, or None."""
    keys = sorted(key for key, value in read.items() if value.is_floating_point())
    first = torch.tensor(len(keys))
    for index, key in enumerate(keys):
        value = read[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if not bool(torch.isfinite(local).all()):
            first = torch.tensor(index)
            break
    if dist.is_initialized():
        first = first.to(_device_of(read))
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    index = int(first.item())
    return keys[index] if index < len(keys) else None


def _device_of(read: dict[str, torch.Tensor]) -> torch.device:
    """Where the collectives of the model's process group run: its tensors' device."""
    value = next(iter(read.values()), None)
    if value is None:
        return torch.device("cpu")
    return (value.to_local() if isinstance(value, DTensor) else value).device


def _names_of_each_parameter(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's name, with every name of that parameter (more than one where it is tied)."""
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    return {name: names for names in by_param.values() for name in names}
