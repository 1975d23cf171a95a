"""An FSDP2 training script ported by replacing ``fully_shard`` with ``shardwire.shard`` and nothing else
trains as FSDP2 does and saves a complete DCP checkpoint.

The script is the one an FSDP2 user writes: nanoGPT's weight-decay groups by ``p.dim()``, torch's
``clip_grad_norm_`` and its DTensor norm (``.full_tensor()``), and ``dcp.save`` of ``get_state_dict``
with no registration. Each case runs FSDP2 and shardwire in the same processes, on the same batches.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from harness import run_workers
from shardwire.models.gpt import PRESETS

pytestmark = pytest.mark.slow

STEPS = 12
TWO_BLOCKS = dataclasses.replace(PRESETS["tiny"], layers=2)


def fsdp2(model, group_size: int):
    """FSDP2's ``fully_shard`` on every block and the root, over the world or in groups (HSDP)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if group_size == world:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shardwire_shard(model, group_size: int):
    """The port: the same model sharded by ``shardwire.shard``, its blocks the units."""
    import torch.distributed as dist

    import shardwire
    from shardwire.models.gpt import Block

    layout = "full" if group_size == dist.get_world_size() else "hybrid"
    return shardwire.shard(model, units=[Block], layout=layout, shard_group_size=group_size)


def script(rank, world, shard, group_size, checkpoint):
    """An FSDP2 user's training script; ``shard`` is the one line a port changes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardwire.models.gpt import GPT, loss_fn

    torch.manual_seed(0)
    model = shard(GPT(TWO_BLOCKS), group_size)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, TWO_BLOCKS.vocab_size, (2 * world, TWO_BLOCKS.seq_len + 1), generator=generator)
        mine = tokens[2 * rank : 2 * rank + 2]
        loss = loss_fn(model(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        norms.append(norm.full_tensor().item())
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint)
    return losses, norms, len(decay), len(no_decay)


def _both(rank, world, group_size, root):
    return {name: script(rank, world, shard, group_size, f"{root}/{name}")
            for name, shard in (("fsdp2", fsdp2), ("shardwire", shardwire_shard))}


def saved(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.with_suffix(".pt")
    dcp_to_torch_save(checkpoint, target)

    def flatten(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from flatten(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, torch.Tensor):
            yield prefix, value

    return dict(flatten("", torch.load(target, weights_only=True)))


@pytest.mark.parametrize("world, group_size", [(2, 2), (3, 3), (2, 1), (4, 2)],
                         ids=["full-2", "full-3", "hybrid-2x1", "hybrid-2x2"])
def test_a_ported_fsdp2_script_trains_and_saves_as_fsdp2(world, group_size, tmp_path):
    results = run_workers(world, _both, group_size, str(tmp_path), timeout=300)
    theirs, ours = results[0]["fsdp2"], results[0]["shardwire"]
    assert ours[2:] == theirs[2:] == (10, 16)  # p.dim() puts matrices and vectors where FSDP2 does
    for what, mine, expected in (("loss", ours[0], theirs[0]), ("clip norm", ours[1], theirs[1])):
        worst = max(abs(a - b) for a, b in zip(mine, expected))
        assert worst <= 1e-5, f"{what} differs from FSDP2's by {worst:.2e}: {mine} against {expected}"

    # a complete checkpoint: every tensor FSDP2's holds, its chunks covering it exactly, the same values
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, value in FileSystemReader(tmp_path / "shardwire").read_metadata().state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            assert sum(math.prod(chunk.sizes) for chunk in value.chunks) == math.prod(value.size), key
    ours, theirs = saved(tmp_path / "shardwire"), saved(tmp_path / "fsdp2")
    assert ours.keys() == theirs.keys()
    assert any(key.endswith("exp_avg") for key in ours)
    for key, value in theirs.items():
        assert ours[key].shape == value.shape, key
        assert torch.allclose(ours[key], value, rtol=1e-4, atol=1e-6), f"{key}: {(ours[key] - value).abs().max()}"
