"""FLOP accounting: the standard per-token count, torch's own count as a cross-check, and a probe of
what the hardware actually delivers.

Model FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): a training step costs, per token,
``6 N + 12 L H S`` FLOPs, where N counts the parameters that take part in matrix multiplies (6 = 2
for the forward multiply-add, 4 for the two backward ones), L is the number of layers, H the hidden
size and S the sequence length (the attention scores and their use, forward and backward, without
discounting the causal mask). In shardwire's GPT the output head is tied to the token embedding, so
that matrix is counted once, as the head; the position embedding is a lookup and is not counted.

Hardware FLOPs add what the machine computes beyond the model's count: with activation checkpointing
every unit's forward runs a second time in backward, ``2 N_units + 4 L H S`` more per token. MFU uses
model FLOPs; HFU uses hardware FLOPs.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from shardwire.gpus import datasheet_tflops
from shardwire.models.gpt import GPT, GPTConfig, loss_fn


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    model: float
    hardware: float
    definition: str


def gpt_flops_per_token(config: GPTConfig, *, activation_checkpointing: bool = False) -> FlopsPerToken:
    h, layers, seq = config.hidden, config.layers, config.seq_len
    matmul_params = config.num_params() - config.seq_len * h  # all but the position lookup
    attention = 12 * layers * h * seq
    model = 6 * matmul_params + attention
    block_params = layers * (12 * h * h + 10 * h)
    recompute = (2 * block_params + attention / 3) if activation_checkpointing else 0.0
    return FlopsPerToken(
        model=float(model),
        hardware=float(model + recompute),
        definition="6N + 12LHS per token (PaLM, appendix B); N = parameters in matrix multiplies",
    )


def torch_counted_flops_per_token(config: GPTConfig, batch: int = 1) -> float:
    """Training FLOPs per token as torch's FlopCounterMode counts them for one forward and backward.

    Runs on the meta device: shapes only, no memory, no time. It counts matrix multiplies and
    attention (torch's SDPA formula) and so should agree with the closed form to within the
    small terms the closed form also ignores.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = GPT(config)
        tokens = torch.zeros(batch, config.seq_len + 1, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return counter.get_total_flops() / (batch * config.seq_len)


def datasheet_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The vendor's dense peak for ``device`` computing in ``dtype`` (fp32 as TF32 when torch is
    allowed to use it), or None for a device not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if dtype in (torch.bfloat16, torch.float16):
        kind = "bf16"
    elif dtype == torch.float32:
        kind = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    else:
        return None
    return datasheet_tflops(name, kind)


def probe_peak_tflops(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> float:
    """TFLOP/s this process reaches on a large square matrix multiply in ``dtype`` (pass the
    training's compute dtype): the peak MFU is measured against when none is given or known. Run it
    on every rank at once, so each sees the sharing it will see in training. It synchronizes the
    device, so call it outside the steps being measured."""
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm up kernels and caches
    _synchronize(device)
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            torch.mm(a, b)
        iterations += 4
        _synchronize(device)
    elapsed = time.perf_counter() - start
    return 2 * size**3 * iterations / elapsed / 1e12


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
