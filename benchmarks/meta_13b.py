"""A model no worker here could hold, trained as one rank of a large world: a Llama-2-13B-shaped
Hugging Face model (13.0B parameters, 48.5 GiB in fp32) built on the meta device, sharded with bf16
compute (``--precision``) as rank 0 of a fake world (torch's fake process group,
``tests/fake_world.py``) of ``--world`` ranks, ``--per-node`` to a node, and trained ``--steps`` steps
at a short sequence on the CPU or one GPU (``--device``). Its peak memory against ``shardwire.sim.memory``'s, for making the
model and for its steps.

    python benchmarks/meta_13b.py --world 64 --per-node 8 --seq-len 16 --steps 2 \
        --json benchmarks/results/meta_13b.json

Memory on the CPU is the process's resident set (with glibc told to give freed tensors back, so that
its peak counts live tensors): the kernel's high-water mark, reset as each phase starts, less what the
process held before building the model (torch, transformers, the fake group). With ``--device cuda``
it is what torch's allocator handed out on the GPU, its peak reset as each phase starts. Rank 0 of a fake group computes
as every rank would: it makes every unit's values (to cut its rows) and its forward and backward run
whole; its collectives complete at once.

A CPU without AVX-512 BF16 multiplies bf16 matrices on a slow path when the second operand is not
transposed (a linear layer's input gradient): 16 x 13824 by 13824 x 5120 takes about 25 s there,
against 0.3 s in fp32, so a bf16 step of the 40 layers takes over an hour; ``--precision fp32`` runs
the same memory test in minutes, against the memory model for fp32 compute.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import shardwire  # noqa: E402
from shardwire import worker  # noqa: E402
from fake_world import fake_world  # noqa: E402
from shardwire.sim.architecture import architecture  # noqa: E402
from shardwire.sim.huggingface import spec_from_config  # noqa: E402
from shardwire.sim.memory import GIB, estimate_memory  # noqa: E402
from shardwire.sim.specs import ClusterSpec, LinkSpec, TrainingSpec  # noqa: E402

LLAMA_2_13B = {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
               "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
               "max_position_embeddings": 4096, "tie_word_embeddings": False}


class Meter:
    """The memory the model's device holds: on the CPU the process's resident set, its peak the
    kernel's high-water mark; on a GPU what torch's caching allocator has handed out."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now_gib(self) -> float:
        if self.cuda:
            return torch.cuda.memory_allocated() / GIB
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / GIB

    def reset_peak(self) -> None:
        """The peak starts again from here."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")

    def peak_gib(self) -> float:
        """The peak since the last ``reset_peak``."""
        if self.cuda:
            return torch.cuda.max_memory_allocated() / GIB
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024 / GIB


def modelled(config, world: int, per_node: int, seq_len: int, precision: str):
    """What the memory model says rank 0 holds, making the model and at its step's peak."""
    spec = spec_from_config(config.to_dict(), name="llama-2-13b-shaped", seq_len=seq_len, gated=True)
    link = LinkSpec(busbw_GBps=1.0)  # the memory model reads the cluster's shape, not its speeds
    cluster = ClusterSpec(nodes=world // per_node, gpus_per_node=per_node, peak_tflops=1.0, gpu_memory_gb=80.0,
                          intra_node=link, inter_node=link)
    training = TrainingSpec(micro_batch=1, precision=precision, reduce_precision="fp32")
    return estimate_memory(architecture(spec, training.compute_bytes), cluster, training)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="the units' compute dtype (master weights stay fp32)")
    parser.add_argument("--layers", type=int, default=LLAMA_2_13B["num_hidden_layers"],
                        help="fewer decoder layers than Llama 2 13B's 40, to try the script quickly")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    meter = Meter(device)

    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: freed tensors go back
    config = transformers.AutoConfig.for_model(**{**LLAMA_2_13B, "num_hidden_layers": args.layers})
    figures: dict[str, object] = {"world": args.world, "per_node": args.per_node, "seq_len": args.seq_len,
                                  "layers": args.layers, "precision": args.precision, "device": args.device}
    if device.type == "cuda":
        figures["device_name"] = torch.cuda.get_device_name()
    with fake_world(args.world, args.per_node, rank=0):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        figures["parameters"] = sum(p.numel() for p in model.parameters())
        before = meter.now_gib()
        meter.reset_peak()
        torch.manual_seed(0)
        started = time.perf_counter()
        mixed_precision = "bf16" if args.precision == "bf16" else None
        shardwire.shard(model, units=[LlamaDecoderLayer], mixed_precision=mixed_precision, device=device)
        worker.synchronize(device)  # the GPU's initialisation runs behind the host
        figures["make_s"] = time.perf_counter() - started
        figures["made_peak_gib"] = meter.peak_gib() - before
        figures["shards_gib"] = sum(p.to_local().numel() * 4 for p in model.parameters()) / GIB
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        tokens = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)
        losses, times = [], []
        meter.reset_peak()
        for _ in range(args.steps):
            started = time.perf_counter()
            loss = model(tokens, labels=tokens, use_cache=False).loss  # the model shifts the labels
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # waits for the device
            times.append(time.perf_counter() - started)
        figures.update(losses=losses, step_s=times, peak_gib=meter.peak_gib() - before, before_gib=before)
    estimate = modelled(config, args.world, args.per_node, args.seq_len, args.precision)
    figures.update(modelled_construction_gib=estimate.construction / GIB, modelled_step_gib=estimate.total / GIB,
                   whole_fp32_gib=figures["parameters"] * 4 / GIB)
    print(f"{figures['parameters'] / 1e9:.2f}B parameters ({figures['whole_fp32_gib']:.1f} GiB in fp32), rank 0 of "
          f"{args.world} ({args.per_node} per node), sequences of {args.seq_len}, {args.precision} compute on "
          f"{figures.get('device_name', args.device)}")
    print(f"made in {figures['make_s']:.1f} s: peak {figures['made_peak_gib']:.2f} GiB beyond the "
          f"{figures['before_gib']:.2f} GiB held before (shards {figures['shards_gib']:.2f} GiB); memory model "
          f"{figures['modelled_construction_gib']:.2f} GiB")
    print(f"{args.steps} steps ({', '.join(f'{t:.0f} s' for t in times)}; "
          f"loss {', '.join(f'{x:.3f}' for x in losses)}): peak {figures['peak_gib']:.2f} GiB; memory model {figures['modelled_step_gib']:.2f} GiB at the step's peak")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
