"""One GPU: shardwire's overhead and MFU against the same GPT unsharded and under FSDP2.

    python benchmarks/gpu_single.py --json benchmarks/results/gpu_single.json --trace runs/gpu_trace

At world 1 shardwire runs all of its machinery (flat buffers, gathers into them, prefetch,
reductions, casts, side streams) with nothing to wait for on the wire, so what separates it from the
unsharded model is its overhead. Its collectives there are local copies on the side streams (a group
of one calls no NCCL collective); FSDP2's call NCCL's. Three systems train the same GPT (``models/gpt.py``'s GPU sizes,
2048 positions) on random tokens with AdamW (fused by default, as torchtitan runs it) and gradient
clipping (``benchmarks/systems.py``):

* unsharded: fp32 weights under torch's bf16 autocast (each forward casts the weights for its
  matrix multiplies; gradients and the optimizer stay in fp32);
* shardwire: ``shard(units=[Block])`` with ``MixedPrecision(bf16, fp32)``: gathered copies in bf16,
  gradients reduced in fp32, fp32 master shards;
* fsdp2: ``fully_shard`` on each Block and on the root with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

All three use SDPA attention (flash kernels on Hopper) and no activation checkpointing.
``--variants`` says how their blocks run, each variant a run of every system: ``eager``; ``compiled``,
each block compiled as torchtitan compiles them (``shard(compile=True)``; ``torch.compile`` of each
block before ``fully_shard``, and of each block of the unsharded model); ``fp8``, compiled with the
blocks' linear layers converted to torchao's float8 training (dynamic tensorwise scales, torchao's
default and torchtitan's), FSDP2 gathering their weights in fp8 as torchtitan runs it. For each size,
``--rounds`` rounds build every run in turn (the order reversed every other round, so that drift
falls on all alike), run ``--warmup`` steps, time ``--steps`` steps (each between two device
synchronizations) and free it. Reported per system: the median step, tokens/s, MFU (6N + 12LHS per
token, ``shardwire.profile.flops``, over the data sheet's dense bf16 peak: 989 TFLOP/s for the H100
SXM and the H200) and the peak memory allocated while it ran.

``--kernels`` profiles two more steps of each run in the last round under ``torch.profiler`` and
sums the device time of its kernels by kind (matrix multiplies, attention, copies and casts,
compiled elementwise kernels, the optimizer, collectives, the rest): printed per size against the
unsharded model's, the largest differences by kernel named, so that where shardwire's step differs
is read off the GPU rather than guessed (on the CPU, the operators' own time).

``--trace DIR`` then profiles the last size under shardwire: the engine's own breakdown over a few
steps (``DIR/profile.json``, naming its job as ``shardwire train --profile`` does, so that
``shardwire simulate --calibrate`` reads it) and one step under ``torch.profiler``, the engine's collectives labelled
``shardwire::op(tag)`` (``DIR/torch_trace.json.gz``, for chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from systems import TrainingStep, compile_blocks, wrap  # noqa: E402

from shardwire import worker  # noqa: E402
from shardwire.models import fp8 as float8  # noqa: E402
from shardwire.models.gpt import GPT, PRESETS, Block  # noqa: E402
from shardwire.profile.flops import datasheet_peak_tflops, flops_per_token  # noqa: E402

SYSTEMS = ("unsharded", "shardwire", "fsdp2")
# eager; compiled: each block compiled; fp8: compiled, the blocks' linear layers multiplying in fp8
VARIANTS = ("eager", "compiled", "fp8")
SIZES = ("gpt-125m", "gpt-350m", "gpt-1.3b")
BATCH = {"gpt-125m": 16, "gpt-350m": 16, "gpt-1.3b": 8}  # sequences per step; fit an 80 GB H100
# What a kernel (on the CPU: an operator) does, read off its name; the first kind that matches.
KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|aten::(?:mm|addmm|bmm|_scaled_mm)$", re.I)),
    ("collective", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("compiled", re.compile(r"^triton", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|CatArray|chunk_cat|aten::cat$|split|aten::to$|aten::_to_copy", re.I)),
)


def build(system: str, variant: str, size: str, batch: int, device: torch.device, dtype: torch.dtype,
          fused: bool) -> TrainingStep:
    config = PRESETS[size]
    torch.manual_seed(0)
    with device:
        model = GPT(config)
    compiled, fp8 = variant != "eager", variant == "fp8"
    if system == "unsharded":
        if fp8:
            float8.convert(model, [Block])
        if compiled:
            compile_blocks(model)
        return TrainingStep(None, model, config, batch, autocast=dtype, fused=fused)
    model = wrap(system, model, compute_dtype=dtype, compile=compiled, fp8=fp8)
    return TrainingStep(system, model, config, batch, fused=fused)


def timed(step: TrainingStep, warmup: int, steps: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        step()
    worker.synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        worker.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def kernel_times(step: TrainingStep, device: torch.device, steps: int = 2) -> dict[str, float]:
    """Each kernel's own device time per step, in ms, by name, over ``steps`` steps under
    torch.profiler (on the CPU: each operator's own time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        worker.synchronize(device)
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = prof.key_averages()
    # a range the host marks (record_function) shows on the GPU too, spanning the kernels inside it
    ranges = {event.key for event in events if event.device_type == DeviceType.CPU} if cuda else set()
    times = {}
    for event in events:
        own_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if event.device_type == kind and own_us > 0 and event.key not in ranges:
            times[event.key] = times.get(event.key, 0.0) + own_us / 1e3 / steps
    return times


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def by_kind(kernels: dict[str, float]) -> dict[str, float]:
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return kinds


def kernel_table(result: dict, top: int = 10) -> str:
    """Each profiled run's kernel time per step by kind next to the unsharded model's of the same
    variant, then the kernels whose time differs most from it."""
    systems = result["systems"]
    lines = []
    for name, row in systems.items():
        base = systems.get(_name("unsharded", row["variant"]))
        if "kernels_ms" not in row or row["system"] == "unsharded" or base is None or "kernels_ms" not in base:
            continue
        mine, theirs = by_kind(row["kernels_ms"]), by_kind(base["kernels_ms"])
        kinds = sorted(set(mine) | set(theirs), key=lambda k: -abs(mine.get(k, 0.0) - theirs.get(k, 0.0)))
        lines.append(f"\nkernel time per step, {name} against {_name('unsharded', row['variant'])} (ms): total "
                     f"{sum(mine.values()):.1f} against {sum(theirs.values()):.1f}")
        lines += [f"  {kind:<11} {mine.get(kind, 0.0):>8.2f} {theirs.get(kind, 0.0):>8.2f} "
                  f"{mine.get(kind, 0.0) - theirs.get(kind, 0.0):>+8.2f}" for kind in kinds]
        names = set(row["kernels_ms"]) | set(base["kernels_ms"])
        differ = sorted(names, key=lambda k: -abs(row["kernels_ms"].get(k, 0.0) - base["kernels_ms"].get(k, 0.0)))
        lines.append(f"  the {top} kernels whose time differs most:")
        lines += [f"  {row['kernels_ms'].get(k, 0.0) - base['kernels_ms'].get(k, 0.0):>+8.2f} "
                  f"{kernel_kind(k):<10} {k[:110]}" for k in differ[:top]]
    return "\n".join(lines)


def measure(size: str, args, device: torch.device, dtype: torch.dtype, peak: float | None) -> dict:
    batch = args.batch or BATCH.get(size, 8)
    config = PRESETS[size]
    tokens = batch * config.seq_len
    flops = flops_per_token(config.spec(size)).model
    runs = [(system, variant) for variant in args.variants for system in args.systems]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    memory: dict[tuple[str, str], int] = {}
    kernels: dict[tuple[str, str], dict[str, float]] = {}
    for round_ in range(args.rounds):
        for system, variant in runs if round_ % 2 == 0 else reversed(runs):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            step = build(system, variant, size, batch, device, dtype, args.optimizer == "fused")
            times[system, variant] += timed(step, args.warmup, args.steps, device)
            if device.type == "cuda":
                memory[system, variant] = max(memory.get((system, variant), 0), torch.cuda.max_memory_allocated(device))
            if args.kernels and round_ == args.rounds - 1:
                kernels[system, variant] = kernel_times(step, device)
            del step
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    systems = {}
    for (system, variant), seconds in times.items():
        step_s = statistics.median(seconds)
        tflops = flops * tokens / step_s / 1e12
        systems[_name(system, variant)] = {
            "system": system,
            "variant": variant,
            "step_times_s": seconds,
            "median_step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "model_tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "peak_memory_bytes": memory.get((system, variant)),
        }
        if (system, variant) in kernels:
            systems[_name(system, variant)]["kernels_ms"] = kernels[system, variant]
    return {"batch": batch, "seq_len": config.seq_len, "params": config.num_params(),
            "flops_per_token": flops, "systems": systems}


def _name(system: str, variant: str) -> str:
    """A run's name: the system, and how its blocks ran where not eagerly ("fsdp2 compiled")."""
    return system if variant == "eager" else f"{system} {variant}"


def table(results: dict) -> str:
    """Each run's figures, and its step over the unsharded model's and FSDP2's of the same variant."""
    lines = [f"{'size':<9} {'system':<19} {'step ms':>8} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} "
             f"{'peak GiB':>8} {'/unsharded':>10} {'/fsdp2':>7}"]
    for size, result in results.items():
        systems = result["systems"]
        for name, row in systems.items():
            ratio = {}
            for other in ("unsharded", "fsdp2"):
                same = systems.get(_name(other, row["variant"]))
                ratio[other] = row["median_step_s"] / same["median_step_s"] if same else None
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
            peak = f"{row['peak_memory_bytes'] / 2**30:.1f}" if row["peak_memory_bytes"] else "-"
            lines.append(
                f"{size:<9} {name:<19} {row['median_step_s'] * 1e3:>8.1f} {row['tokens_per_s']:>9.0f} "
                f"{row['model_tflops']:>8.1f} {mfu:>6} {peak:>8} "
                + " ".join(f"{value:>{width}.3f}x" if value else f"{'-':>{width + 1}}"
                           for value, width in ((ratio["unsharded"], 9), (ratio["fsdp2"], 6))))
    return "\n".join(lines)


def trace(size: str, args, device: torch.device, dtype: torch.dtype, peak: float | None) -> None:
    """The engine's breakdown of a few steps of ``size`` under shardwire, then one step under
    torch.profiler, both written to ``args.trace``."""
    from torch.profiler import ProfilerActivity, profile

    from shardwire.profile.profiler import Profiler

    batch = args.batch or BATCH.get(size, 8)
    config = PRESETS[size]
    variant = args.variants[-1]
    step = build("shardwire", variant, size, batch, device, dtype, args.optimizer == "fused")
    timed(step, args.warmup, 0, device)
    job = {"model": size, "seq_len": config.seq_len, "batch": batch, "grad_accum": 1,
           "precision": "fp8" if variant == "fp8" else "bf16", "activation_checkpointing": False,
           "compile": variant != "eager"}  # as `shardwire train --profile` names its job
    profiler = Profiler(step.model, step.optimizer, tokens_per_step=batch * config.seq_len,
                        flops=flops_per_token(config.spec(size)), peak_tflops=peak, probe_peak=False,
                        metadata={"config": job})
    for _ in range(6):
        with profiler.step():
            step()
    summary = profiler.save(args.trace)
    profiler.close()
    f = {name: stats["max"] for name, stats in summary["figures"].items()}
    mfu = f", MFU {summary['mfu']:.1%}" if "mfu" in summary else ""
    print(f"\nshardwire's profiler, {size}: step {f['step_s'] * 1e3:.1f} ms: forward {f['forward_s'] * 1e3:.1f}, "
          f"backward {f['backward_s'] * 1e3:.1f}, clip {f['clip_s'] * 1e3:.1f}, optimizer "
          f"{f['optimizer_s'] * 1e3:.1f}, other {f['other_s'] * 1e3:.1f}, waiting {f['wait_s'] * 1e3:.1f} ms; "
          f"communication {f['comm_s'] * 1e3:.1f} ms, exposed {f['exposed_comm_s'] * 1e3:.1f} ms{mfu}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as torch_profile:
        step()
        worker.synchronize(device)
    torch_profile.export_chrome_trace(os.path.join(args.trace, "torch_trace.json.gz"))  # torch gzips a .gz
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    print(torch_profile.key_averages().table(sort_by=sort, row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=sorted(PRESETS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--variants", nargs="+", default=["eager"], choices=VARIANTS,
                        help="how the blocks run: eager, compiled (torch.compile per block), fp8 (compiled, "
                             "their linear layers multiplying in fp8 through torchao)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: per size, %s)" % BATCH)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system and round")
    parser.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                        help="AdamW's implementation, the same for every system (default fused, as torchtitan)")
    parser.add_argument("--peak-tflops", type=float, help="for MFU (default: the GPU's data sheet, bf16)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--kernels", action="store_true",
                        help="in the last round, each run's kernel time by kind, against the unsharded model's")
    parser.add_argument("--trace", help="profile the last size under shardwire (the last variant) into this directory")
    args = parser.parse_args()

    device = worker.worker_device("auto")
    cuda = device.type == "cuda"
    worker.ensure_initialized(device)  # a world of one: NCCL on the GPU, gloo on the CPU
    dtype = torch.bfloat16
    peak = args.peak_tflops or datasheet_peak_tflops(device, dtype)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"{name}, torch {torch.__version__}, peak {peak} TFLOP/s; {args.optimizer} AdamW; {args.rounds} rounds "
          f"x {args.steps} timed steps after {args.warmup} per system", flush=True)
    results = {}
    for size in args.sizes:
        results[size] = measure(size, args, device, dtype, peak)
        print(table({size: results[size]}), flush=True)
        if args.kernels:
            print(kernel_table(results[size]), flush=True)
    print("\n" + table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "peak_tflops": peak,
                       "optimizer": args.optimizer, "command": " ".join(sys.argv), "sizes": results}, f, indent=1)
    if args.trace:
        trace(args.sizes[-1], args, device, dtype, peak)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
