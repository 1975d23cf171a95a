"""FLOP accounting: the model's count per token, torch's own count as a cross-check, and a probe of
what the hardware actually delivers.

The count is the simulator's (``shardwire.sim.architecture``), so the profiler's MFU and the
simulator's MFU of the same job are the same quantity: matrix multiplications only, 2 m k n each,
backward twice forward (Megatron-LM's convention, which the published results the simulator is
checked against use). For a GPT it is PaLM's ``6 N + 12 L H S`` per token (Chowdhery et al. 2022,
appendix B), with N the parameters that take part in matrix multiplies (a tied embedding counted
once, as the head; position lookups, biases and norms not at all), L layers, H hidden, S sequence
length (the causal mask not discounted). It takes a model description (``ModelSpec``), not a
model's class: ``GPTConfig.spec()`` describes the project's GPT.

Hardware FLOPs add what the machine computes beyond the model's count: with activation checkpointing
every block's forward runs a second time in backward. MFU uses model FLOPs; HFU uses hardware FLOPs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from shardwire.gpus import datasheet_tflops
from shardwire.worker import synchronize
from shardwire.sim.architecture import architecture
from shardwire.sim.specs import ModelSpec

DEFINITION = "matrix multiplies, backward 2 x forward (Megatron-LM); 6N + 12LHS per token for a GPT"


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    model: float
    hardware: float
    definition: str


def flops_per_token(model: ModelSpec, *, activation_checkpointing: bool = False) -> FlopsPerToken:
    """Training FLOPs per token of ``model``'s input sequence; with ``activation_checkpointing``,
    the engine's, every block's forward is recomputed whole."""
    arch = architecture(model, compute_bytes=2)  # FLOPs do not depend on the activations' dtype
    recomputed = 1.0 if activation_checkpointing else 0.0
    return FlopsPerToken(model=arch.model_flops / model.seq_len,
                         hardware=arch.hardware_flops(recomputed) / model.seq_len, definition=DEFINITION)


def torch_counted_flops_per_token(step: Callable[[], object], tokens: int) -> float:
    """Training FLOPs per token as torch's FlopCounterMode counts ``step()``, one forward and backward
    over ``tokens`` tokens. Run it on the meta device: shapes only, no memory, no time. It counts
    matrix multiplies and attention (torch's SDPA formula) and so should agree with the model's
    count to within the small terms that count also ignores."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / tokens


def datasheet_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The vendor's dense peak for ``device`` computing in ``dtype`` (fp32 as TF32 when torch is
    allowed to use it), or None for a device not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if dtype in (torch.bfloat16, torch.float16):
        kind = "bf16"
    elif dtype == torch.float32:
        kind = "tf32" if matmul_uses_tf32() else "fp32"
    else:
        return None
    return datasheet_tflops(name, kind)


def matmul_uses_tf32() -> bool:
    """Whether torch runs fp32 matrix multiplies on CUDA as TF32: ``fp32_precision`` where torch has it
    (2.9 on; "none" defers to the global setting), else the older ``allow_tf32``, which newer torch
    deprecates and which reads wrong when a program set precision the new way."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return bool(matmul.allow_tf32)
    precision = matmul.fp32_precision
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "ieee")
    return precision == "tf32"


def probe_peak_tflops(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> float:
    """TFLOP/s this process reaches on a large square matrix multiply in ``dtype`` (pass the
    training's compute dtype): the peak MFU is measured against when none is given or known. Run it
    on every rank at once, so each sees the sharing it will see in training. It synchronizes the
    device, so call it outside the steps being measured."""
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm up kernels and caches
    synchronize(device)
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            torch.mm(a, b)
        iterations += 4
        synchronize(device)
    elapsed = time.perf_counter() - start
    return 2 * size**3 * iterations / elapsed / 1e12

