"""The kernels of a ``Codec`` (``shardwire.comm.wire``): rows of values to rows of bytes and back.

Vectorised torch operations on the device the values are on, in fp32 whatever the values' dtype:
a block's scale is its largest magnitude over the format's largest integer, so rounding to the
nearest step moves no element by more than half a step and nothing is clamped.

The CPU and CUDA kernels give the same bytes, so a run's wire does not depend on where it encodes.
That rules out dividing by a Python number: CUDA computes ``tensor / scalar`` as a product with the
scalar's reciprocal, the CPU as a division, and the two differ in the last bit. The scale is taken
as that product on both.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from shardwire.comm.wire import DEFAULT_BLOCK, SCALE_BYTES, Codec


def encode(codec: Codec, rows: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize each row of ``rows`` (2-d, any float dtype) into a row of ``codec.packed_numel``
    bytes: the integers (``8 // bits`` to a byte below 8 bits, offset to be unsigned, the first in
    the lowest bits: int4's two nibbles, low first), then the blocks' fp32 scales.

    With ``residual`` (fp32, the shape of ``rows``), error feedback: it is added to the values before
    quantizing, and replaced by what quantizing them lost, so what one call drops the next sends."""
    count, numel = rows.shape
    blocks, block = codec.blocks(numel), codec.block
    values = rows.float() if residual is None else rows.float() + residual
    padded = F.pad(values, (0, blocks * block - numel)).view(count, blocks, block)
    scales = padded.abs().amax(dim=2, keepdim=True) * (1.0 / codec.largest)
    steps = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(padded / steps).clamp_(-codec.largest, codec.largest)
    if residual is not None:
        residual.copy_((padded - quantized * steps).view(count, -1)[:, :numel])
    packed = torch.empty(count, codec.packed_numel(numel), dtype=torch.uint8, device=rows.device)
    payload_bytes = packed.shape[1] - blocks * SCALE_BYTES
    packed[:, payload_bytes:] = scales.view(count, blocks).view(torch.uint8)
    integers = quantized.view(count, -1).to(torch.int8)
    if codec.bits == 8:
        packed[:, :payload_bytes] = integers.view(torch.uint8)
        return packed
    per_byte = 8 // codec.bits
    fields = F.pad((integers + codec.offset).view(torch.uint8), (0, per_byte * payload_bytes - integers.shape[1]))
    payload = packed[:, :payload_bytes]
    payload.copy_(fields[:, 0::per_byte])
    for field in range(1, per_byte):
        payload.bitwise_or_(fields[:, field::per_byte] << (field * codec.bits))
    return packed


def decode(codec: Codec, packed: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values, ``(rows, numel)``, of rows of bytes that ``encode`` made from ``numel``
    values each; written into ``out`` (``(rows, numel)``, any floating dtype) where given. Rows of
    whole blocks are scaled straight into ``out``, integers converted as they are read: a gather's
    result is then written once, not made in fp32 and copied (it is a step's largest memory pass
    on a quantized wire)."""
    count = packed.shape[0]
    blocks, block = codec.blocks(numel), codec.block
    payload_bytes = packed.shape[1] - blocks * SCALE_BYTES
    scales = packed[:, payload_bytes:].contiguous().view(torch.float32).view(count, blocks, 1)
    payload = packed[:, :payload_bytes]
    if codec.bits == 8:
        integers = payload.contiguous().view(torch.int8)
    else:
        mask, per_byte = (1 << codec.bits) - 1, 8 // codec.bits
        fields = [(payload >> (field * codec.bits)) & mask for field in range(per_byte)]
        integers = torch.stack(fields, dim=2).view(count, -1).view(torch.int8) - codec.offset
    blocked = integers[:, : blocks * block].view(count, blocks, block)
    if out is not None and numel == blocks * block:
        return torch.mul(blocked, scales, out=out.view(count, blocks, block)).view(count, numel)
    values = (blocked * scales).view(count, -1)[:, :numel]
    return values if out is None else out.copy_(values)


def encode_rate(device: torch.device, numel: int = 8_000_000, repeats: int = 5) -> float:
    """Elements per second this process encodes on ``device`` (int8, the default block, error
    feedback off): the median of ``repeats`` encodes of ``numel`` elements, for a simulator that
    prices a quantized wire's kernels where no data sheet gives a rate."""
    codec = Codec(8, DEFAULT_BLOCK)
    values = torch.randn(1, numel, device=device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        encode(codec, values)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times)
