"""fp8 training (``shardwire.models.fp8``, ``train --precision fp8``): the linear layers inside units
multiply in fp8 through torchao, a sharded model trains as the unsharded one does, and what cannot
run says so in one line. On the CPU torch multiplies fp8 in software, so every path runs here."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwire
from harness import run_workers
from shardwire.models import fp8
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

STEPS = 3
LOCAL_BATCH = 2


def test_only_the_linear_layers_inside_units_with_dimensions_of_sixteen_convert():
    model = GPT(PRESETS["tiny"])
    converted = fp8.convert(model, [Block])
    inside = [m for block in model.blocks for m in block.modules() if isinstance(m, nn.Linear)]
    assert converted == len(inside) > 0
    assert all(isinstance(m, Float8Linear) for m in inside)
    assert type(model.head) is nn.Linear  # the root's head stays in the compute dtype


class Mixed(nn.Module):
    """A unit with a linear layer fp8 can multiply, one it cannot (20 is no multiple of 16), and a
    layer that is not an nn.Linear."""

    def __init__(self):
        super().__init__()
        self.fits, self.odd, self.conv = nn.Linear(32, 32), nn.Linear(32, 20), nn.Conv1d(4, 4, 1)

    def forward(self, x):
        return self.odd(self.fits(x))


def test_layers_whose_dimensions_fp8_cannot_multiply_stay_as_they_are():
    model = nn.Sequential(Mixed(), nn.Linear(20, 16))
    assert fp8.convert(model, [Mixed]) == 1
    assert isinstance(model[0].fits, Float8Linear)
    assert type(model[0].odd) is nn.Linear and type(model[0].conv) is nn.Conv1d and type(model[1]) is nn.Linear
    tokens = torch.randn(3, 7, 32)  # 21 tokens: the weight gradient's multiply is padded to 32
    model(tokens).sum().backward()
    assert model[0].fits.weight.grad is not None


def test_a_model_with_nothing_to_convert_is_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.convert(nn.Sequential(nn.Sequential(nn.Linear(10, 10))), [nn.Sequential])
    with pytest.raises(ValueError, match="hold no nn.Linear layer"):
        fp8.convert(nn.Sequential(nn.Sequential(nn.Conv1d(16, 16, 1))), [nn.Sequential])


def train(model, batches, world: int, rank: int | None) -> list[float]:
    """Each step's loss over the global batch. ``rank`` None: ``model`` is unsharded and runs each
    rank's rows as a forward of its own (fp8's scales are per tensor, so only the same rows give the
    same scales), averaging their losses as the ranks' reduction does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    losses = []
    for tokens in batches:
        parts = range(world) if rank is None else [rank]
        loss = sum(loss_fn(model(rows[:, :-1]), rows[:, 1:])
                   for rows in (tokens[p * LOCAL_BATCH:(p + 1) * LOCAL_BATCH] for p in parts)) / len(parts)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    return losses


def sharded_against_unsharded(rank, world):
    torch.manual_seed(0)
    base = GPT(PRESETS["tiny"])
    fp8.convert(base, [Block])
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, base.config.vocab_size, (world * LOCAL_BATCH, base.config.seq_len + 1),
                             generator=gen) for _ in range(STEPS)]
    unsharded = train(copy.deepcopy(base), batches, world, None)
    sharded = train(shardwire.shard(copy.deepcopy(base), units=[Block]), batches, world, rank)
    return unsharded, sharded


@pytest.mark.slow
def test_a_sharded_fp8_model_trains_as_the_unsharded_one():
    unsharded, sharded = run_workers(2, sharded_against_unsharded)[0]
    assert sharded == pytest.approx(unsharded, rel=1e-5)


def run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_with_fp8_trains_and_says_so():
    run = run_train("--precision", "fp8", "--steps", "4", "--batch", "2", "--log-every", "2", "--eval-batches", "1")
    assert run.returncode == 0, run.stderr
    assert "fp8 (12 linear layers);" in run.stdout and "done: 4 steps" in run.stdout
    assert "Failed to load" not in run.stderr  # torchao's import is quiet


@pytest.mark.slow
def test_a_model_fp8_cannot_convert_is_refused_before_any_worker_starts():
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64,
            "bos_token_id": 0, "eos_token_id": 0}  # its layers are transformers' Conv1D, not nn.Linear
    run = subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "hf:" + json.dumps(gpt2),
                          "--precision", "fp8", "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: --precision fp8: the units (GPT2Block) hold no nn.Linear layer, the only kind torchao's fp8 "
        "training converts: train in bf16"]


def test_fp8_without_torchao_is_one_line():
    code = ("import sys; sys.modules['torchao'] = None; from shardwire.cli import main; "
            "sys.exit(main(['train', '--model', 'tiny', '--precision', 'fp8', '--steps', '1']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip() == "error: --precision fp8 needs torchao, which is not installed: pip install 'shardwire[fp8]'"


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    problem = fp8.unavailable("nccl")
    assert "compute capability 8.9" in problem and "A100" in problem and "--precision bf16" in problem
