"""fp8 where it pays: a model as wide as Llama 3 8B, its compiled step in fp8 against bf16 on one GPU.

    python benchmarks/gpu_fp8.py --layers 12 --seq-len 8192 --kernels --json benchmarks/results/gpu/fp8_8b.json

At the 1.3B GPT's width (hidden 2048) fp8's casts and scale reductions take back most of what the fp8
tensor cores give; torchtitan measures fp8 28% faster at Llama 3 8B. This times a Hugging Face Llama
of Llama 3 8B's widths (hidden 4096, FFN 14336, 32 heads of which 8 for keys and values, vocabulary
128256) with ``--layers`` decoder layers, so that it fits one GPU with its AdamW state, on one
sequence of ``--seq-len`` random tokens a step, at world 1:

* shardwire: built on the meta device and made by ``shard`` (``units=[LlamaDecoderLayer]``,
  ``MixedPrecision(bf16, fp32)``, ``compile=True``), as ``shardwire train --model hf:...`` makes it;
* unsharded: the same model built on the GPU, fp32 weights under bf16 autocast, each decoder layer
  compiled.

Each in bf16 and in fp8 (the decoder layers' linear layers converted by ``shardwire.models.fp8``, the
head in bf16, as torchtitan leaves it); fused AdamW and gradient clipping. ``--rounds`` rounds build
every run in turn, time ``--steps`` steps after ``--warmup`` and free it. Reported: the median step,
tokens/s, the peak memory and each system's fp8 step over its bf16 one; with ``--kernels``, the last
round's kernel time by kind (``gpu_single.py``'s), fp8 against bf16; with ``--host``, whether the GPU
waits for the host: one step's time to be issued by the host from an idle GPU against its whole time,
the kernels it launches, and the times it makes the host wait for the GPU (a synchronization, which
``torch.cuda.set_sync_debug_mode`` reports). A host that needs as long to issue a step as the step
takes, with fewer kernels than CUDA's launch queue holds (1,024), sets the step; one that issues it in
a fraction of that does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_single import by_kind, kernel_times, timed  # noqa: E402
from systems import clip  # noqa: E402

import shardwire  # noqa: E402
from shardwire import worker  # noqa: E402
from shardwire.models import fp8 as float8  # noqa: E402

LLAMA_3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}
SYSTEMS = ("shardwire", "unsharded")
PRECISIONS = ("bf16", "fp8")


class Step:
    """A step on one sequence of random tokens: forward with the loss, backward, clipping, AdamW."""

    def __init__(self, system: str, model: torch.nn.Module, vocab: int, seq_len: int, device: torch.device):
        self.system, self.model, self.vocab, self.seq_len = system, model, vocab, seq_len
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        self.generator = torch.Generator(device).manual_seed(0)
        self.device = device

    def __call__(self) -> None:
        tokens = torch.randint(0, self.vocab, (1, self.seq_len), generator=self.generator, device=self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.system == "unsharded"):
            # the model shifts the labels; training reads no KV cache (building one recompiles each layer)
            loss = self.model(tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        clip("shardwire" if self.system == "shardwire" else None, self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def host_view(step: Step, device: torch.device) -> dict:
    """One step from an idle GPU: the host's time to issue it, the whole step's, its kernels and the
    synchronizations it makes (see the module's docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    worker.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        step()
        issued = time.perf_counter() - start
        torch.cuda.set_sync_debug_mode(0)
    worker.synchronize(device)
    whole = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        worker.synchronize(device)
    kernels = sum(event.count for event in prof.key_averages() if event.device_type == DeviceType.CUDA)
    # each synchronizing call is one warning; the mode's own notice that it is a prototype is none
    syncs = [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
    return {"issued_ms": issued * 1e3, "step_ms": whole * 1e3, "kernels": kernels, "synchronizations": len(syncs),
            "first_synchronization": syncs[0] if syncs else None}


def build(system: str, precision: str, config, seq_len: int, device: torch.device) -> Step:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    with torch.device("meta" if system == "shardwire" else device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if precision == "fp8":
        float8.convert(model, [LlamaDecoderLayer])
    if system == "shardwire":
        shardwire.shard(model, units=[LlamaDecoderLayer], device=device, compile=True,
                        mixed_precision=shardwire.MixedPrecision(torch.bfloat16, torch.float32))
    else:
        for index, layer in enumerate(model.model.layers):
            model.model.layers[index] = torch.compile(layer)
    return Step(system, model, config.vocab_size, seq_len, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (Llama 3 8B has 32)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens a step (one sequence)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run and round")
    parser.add_argument("--kernels", action="store_true", help="the last round's kernel time by kind")
    parser.add_argument("--host", action="store_true", help="the last round's host view of one step (GPU only)")
    parser.add_argument("--hidden", type=int, help="another width, to try the script on a small machine")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import transformers

    device = worker.worker_device("auto")
    worker.ensure_initialized(device)  # a world of one: NCCL on the GPU, gloo on the CPU
    shape = {**LLAMA_3_8B, "num_hidden_layers": args.layers}
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2, vocab_size=1024)
    config = transformers.AutoConfig.for_model(**shape)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = None
    runs = [(system, precision) for system in args.systems for precision in PRECISIONS]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    memory: dict[tuple[str, str], int] = {}
    kernels: dict[tuple[str, str], dict[str, float]] = {}
    hosts: dict[tuple[str, str], dict] = {}
    for round_ in range(args.rounds):
        for system, precision in runs if round_ % 2 == 0 else reversed(runs):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            step = build(system, precision, config, args.seq_len, device)
            params = sum(p.numel() for p in step.model.parameters())
            times[system, precision] += timed(step, args.warmup, args.steps, device)
            if device.type == "cuda":
                memory[system, precision] = torch.cuda.max_memory_allocated(device)
            if args.kernels and round_ == args.rounds - 1:
                kernels[system, precision] = kernel_times(step, device)
            if args.host and device.type == "cuda" and round_ == args.rounds - 1:
                hosts[system, precision] = host_view(step, device)
            print(f"{system} {precision}: median {statistics.median(times[system, precision]) * 1e3:.1f} ms",
                  flush=True)
            del step
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print(f"\n{name}, torch {torch.__version__}: {params / 1e9:.2f}B parameters ({args.layers} layers of Llama 3 "
          f"8B's widths), {args.seq_len} tokens a step, {args.rounds} round(s) x {args.steps} steps")
    print(f"{'system':<10} {'precision':<9} {'step ms':>8} {'tokens/s':>9} {'peak GiB':>8} {'fp8/bf16':>8}")
    results = {}
    for system, precision in runs:
        step_s = statistics.median(times[system, precision])
        bf16_s = statistics.median(times[system, "bf16"])
        peak = memory.get((system, precision))
        results[f"{system} {precision}"] = {"step_times_s": times[system, precision], "median_step_s": step_s,
                                            "tokens_per_s": args.seq_len / step_s, "peak_memory_bytes": peak,
                                            "kernels_ms": kernels.get((system, precision)),
                                            "host": hosts.get((system, precision))}
        print(f"{system:<10} {precision:<9} {step_s * 1e3:>8.1f} {args.seq_len / step_s:>9.0f} "
              f"{peak / 2**30 if peak else float('nan'):>8.1f} {step_s / bf16_s:>8.3f}")
    for system in args.systems:
        if (system, "fp8") in kernels and (system, "bf16") in kernels:
            fp8, bf16 = by_kind(kernels[system, "fp8"]), by_kind(kernels[system, "bf16"])
            print(f"{system}, kernel time per step by kind, fp8 against bf16 (ms): " + ", ".join(
                f"{kind} {fp8.get(kind, 0.0):.1f}/{bf16.get(kind, 0.0):.1f}" for kind in sorted(set(fp8) | set(bf16))))
    for (system, precision), host in hosts.items():
        print(f"{system} {precision}, one step from an idle GPU: issued by the host in {host['issued_ms']:.1f} ms of "
              f"{host['step_ms']:.1f} ms, {host['kernels']} kernels, {host['synchronizations']} synchronizations"
              + (f" (the first: {host['first_synchronization']})" if host["synchronizations"] else ""))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": name, "torch": torch.__version__, "command": " ".join(sys.argv), "layers": args.layers,
                       "seq_len": args.seq_len, "parameters": params, "runs": results}, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
