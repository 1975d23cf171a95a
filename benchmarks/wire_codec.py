"""The quantized wire's block size: error and kernel time of each block on a real gradient.

    python benchmarks/wire_codec.py --out benchmarks/results/wire/codec.md

The values are one step's gradient of the benchmarks' GPT (``30m``, 32M parameters, random
tokens), all its parameters flattened, which holds what makes block size matter: layers whose
gradients differ by orders of magnitude side by side, and outliers. For int8 and int4 and each
block size: bytes per element on the wire, the relative error (the norm of what quantization moved
over the norm of the gradient), and the medians of encode and decode time (on this machine's CPU,
one thread, as a lane thread runs them). Smaller blocks cost scale bytes and kernel time; larger
ones let one outlier coarsen more elements.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardwire.comm.quantize import decode, encode
from shardwire.comm.wire import Codec
from shardwire.models.gpt import GPT, PRESETS, loss_fn

BLOCKS = (32, 64, 128, 256, 512, 1024, 4096)


def gradient() -> torch.Tensor:
    torch.manual_seed(0)
    config = PRESETS["30m"]
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    values = gradient().view(1, -1)
    numel = values.shape[1]
    lines = [f"`python benchmarks/wire_codec.py{' --out ' + args.out if args.out else ''}` ({numel:,} elements)", "",
             "| format | block | bytes/element | relative error | encode | decode |", "|---|---|---|---|---|---|"]
    for bits in (8, 4):
        for block in BLOCKS:
            codec = Codec(bits, block)
            packed = encode(codec, values)
            error = float((decode(codec, packed, numel) - values).norm() / values.norm())
            encode_s = timed(lambda: encode(codec, values), args.repeats)
            decode_s = timed(lambda: decode(codec, packed, numel), args.repeats)
            lines.append(f"| int{bits} | {block} | {codec.wire_bytes_per_element(numel):.3f} | {error:.4f} "
                         f"| {numel / encode_s / 1e6:.0f} M elements/s | {numel / decode_s / 1e6:.0f} M elements/s |")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
