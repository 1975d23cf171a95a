"""``shardwire train``: train a byte-level GPT with the sharded engine.

Run as is, it starts ``--nproc`` local workers through torch's elastic launcher. The same command
under torchrun (``torchrun --nnodes 2 --nproc-per-node 8 -m shardwire train --backend nccl``) runs
in the launcher's world instead. The whole job is the plain loop in ``train``; its settings are the
``TrainConfig`` below.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import time

import torch
import torch.distributed as dist

import shardwire
from shardwire import worker
from shardwire.comm.wire import Wire
from shardwire.data import BIN_DTYPES, load_corpus
from shardwire.engine.checkpoint.schema import fits
from shardwire.engine.shard import engine_of
from shardwire.engine.layout import LAYOUTS, group_size
from shardwire.extras import require
from shardwire.launch import launch_local, torchrun_command, under_launcher
from shardwire.models.choice import ModelChoice, choose
from shardwire.models.gpt import PRESETS, loss_fn
from shardwire.options import (
    OptionError,
    add_options,
    check_bounds,
    check_output_file,
    check_writable_directory,
    command_line,
    config_from,
    option,
)
from shardwire.profile.comm import CommSummary
from shardwire.profile.flops import flops_per_token, torch_counted_flops_per_token
from shardwire.profile.profiler import Profiler
from shardwire.progress import ProgressBar, format_duration, format_rate
from shardwire.scalars import ScalarLog


@dataclasses.dataclass
class TrainConfig:
    """The job's settings; each is a ``shardwire train`` option (``seq_len`` is ``--seq-len``) and a
    key of its ``--config`` file."""

    model: str = option(
        "small", f"a GPT preset ({', '.join(sorted(PRESETS))}), or hf:PATH_OR_JSON: a Hugging Face causal LM "
                 f"from a local directory (its weights, if it holds them), a config .json or an inline JSON config")
    units: str | None = option(None, "hf: comma-separated module classes to shard into (default: the model's "
                                     "_no_split_modules, its transformer block)")
    seq_len: int | None = option(None, "tokens per sequence (default: the preset's; hf: the model's positions, "
                                       "at most 1024)", at_least=2)
    nproc: int | None = option(None, "local worker processes (default: one per visible GPU with NCCL, 2 on CPU; "
                                     "ignored under torchrun)", at_least=1)
    steps: int = option(400, "optimizer steps", at_least=1)
    batch: int = option(16, "sequences per rank and micro-batch", at_least=1)
    grad_accum: int = option(1, "micro-batches per step (all but the last under no_sync)", at_least=1)
    lr: float = option(3e-3, "peak learning rate (warmup, then cosine)", above=0)
    warmup: int = option(40, "warmup steps", at_least=0)
    weight_decay: float = option(0.1, "AdamW's weight decay of matrices (biases and norms get none)", at_least=0)
    clip: float = option(1.0, "max global gradient norm (0: off)", at_least=0)
    precision: str = option("fp32", "compute dtype (master weights stay fp32)", choices=("fp32", "bf16", "fp16"))
    backend: str = option("auto", "auto: NCCL when CUDA is available, else gloo", choices=worker.BACKENDS)
    prefetch: int = option(2, "units gathered ahead of use", at_least=0)
    reshard: bool = option(True, "release each unit's parameters after forward and gather again for backward")
    layout: str = option(
        "full", "full: over every rank; hybrid: within groups, replicated across them; hybrid_secondary: full, "
                "with backward gathering within groups (ZeRO++ hpZ)", choices=LAYOUTS)
    shard_group_size: int | None = option(
        None, "ranks per shard group for the hybrid layouts (default: the ranks of a node)", at_least=1)
    wire: str = option(
        "none", "what crosses nodes: none, int8 (parameters and gradients), or key=value pairs such as "
                "params=int8,grads=int4,block=256 (only collectives that span nodes quantize)")
    activation_checkpointing: bool = option(False, "recompute each unit's activations in backward")
    data: str | None = option(
        None, "text file or directory, read as bytes, or pre-tokenised ids: a flat .bin (nanoGPT's) or a .npy "
              "file (default: Python's stdlib sources)")
    token_dtype: str = option("uint16", "element type of a .bin --data file: nanoGPT's uint16, or uint32 for "
                                        "vocabularies past 65,536 (a .npy says its own)", choices=BIN_DTYPES)
    tokenizer: str | None = option(
        None, "a local Hugging Face tokenizer: tokenise the text --data once, with a progress bar, into a .npy "
              "beside it, and train on its ids", metavar="DIR")
    seed: int = option(0, "seed of the weights and the batches", at_least=0)
    log_every: int = option(10, "steps between progress updates (reading the loss waits for the GPU)", at_least=1)
    eval_batches: int = option(8, "validation batches per evaluation", at_least=1)
    eval_every: int = option(0, "steps between validation losses, shown as val in the progress line "
                                "(0: at the end only)", at_least=0)
    checkpoint_dir: str | None = option(None, "save checkpoints here; running again resumes from the newest good one")
    save_every: int = option(100, "steps between checkpoints (the last step is always saved)", at_least=1)
    keep: int = option(3, "newest checkpoints to keep (0: all)", at_least=0)
    max_restarts: int = option(0, "restart failed local workers this many times; they resume from the newest "
                                  "checkpoint", at_least=0)
    timeout: float = option(600.0, "seconds a collective may take before the job stops with an error naming it",
                            above=0, unit="seconds")
    profile: bool = option(False, "profile every step; writes profile.json and trace.json to --run-dir")
    run_dir: str | None = option(None, "profile output directory (default runs/<date-time>)")
    peak_tflops: float | None = option(None, "peak TFLOP/s per worker for MFU (default: a GPU's data sheet, or a "
                                             "matmul probe)", above=0, real=True)
    tensorboard: str | None = option(
        None, "write loss, learning rate, tokens/s, step time, communication and exposed communication (and MFU "
              "with --profile) as TensorBoard scalars here, each log interval", metavar="DIR")
    log_jsonl: str | None = option(None, "append the same scalars to this file as JSON lines", metavar="FILE")
    print_launch: bool = option(False, "print the torchrun command that runs this job on each of --nnodes nodes, "
                                       "and exit")
    nnodes: int = option(1, "with --print-launch: nodes", at_least=1)
    nproc_per_node: int | None = option(None, "with --print-launch: workers per node (default: as --nproc)",
                                        at_least=1)


# Options that say where and how to start the workers, not what they train.
_LAUNCH_OPTIONS = ("nproc", "max_restarts", "print_launch", "nnodes", "nproc_per_node")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, TrainConfig)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Entry point of ``shardwire train``: launch local workers, or be one."""
    config = config_from(args, TrainConfig)
    _validate(config)
    if config.print_launch:
        print(f"# on each of the {config.nnodes} node(s); HEAD_ADDRESS: the first node's address, which every "
              f"node must reach\n{_launch_command(config)}")
        return 0
    if config.nproc is None:
        config.nproc = _local_workers(config)
    if not under_launcher():
        return launch_local(config.nproc, ["train", *argv], max_restarts=config.max_restarts)
    train(config)
    return 0


def _launch_command(config: TrainConfig) -> str:
    """The torchrun command for ``--print-launch``: this job's options, written back from the config."""
    defaults = TrainConfig()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)
               if f.name not in _LAUNCH_OPTIONS and getattr(config, f.name) != getattr(defaults, f.name)}
    argv = ["train", *command_line(changed)]
    _, per_node = _world_and_node_size(config)
    return torchrun_command(config.nnodes, per_node, argv, max_restarts=config.max_restarts)


def _local_workers(config: TrainConfig) -> int:
    """Workers on this machine by default: one per GPU with NCCL, else 2."""
    return torch.cuda.device_count() if worker.uses_cuda(config.backend) else 2


def _world_and_node_size(config: TrainConfig) -> tuple[int, int]:
    """The ranks the job will have, and on each node: with --print-launch, the cluster's; under a
    launcher, its; else the local workers'."""
    if config.print_launch:
        per_node = config.nproc_per_node or config.nproc or _local_workers(config)
        return config.nnodes * per_node, per_node
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local = config.nproc or _local_workers(config)
    return local, local


def _describe_layout(engine) -> str:
    layout = engine.layout
    if layout.replicate is not None:
        return f"hybrid ({layout.replicate.world} groups of {layout.shard.world})"
    if layout.secondary is not None:
        return f"hybrid_secondary (backward within groups of {layout.secondary.world})"
    return "full" if layout.name == "full" else f"{layout.name} in one group (as full)"


def _describe_wire(engine, wire: str) -> str:
    wire = Wire.parse(wire)
    if wire.quantized and engine.comm.placement.nodes == 1:
        return f"wire {wire} (unused: all ranks share a node, and only what crosses nodes is quantized)"
    return f"wire {wire}"


def _validate(config: TrainConfig) -> None:
    """Everything that can be known wrong before a worker starts, as one line and exit status 1."""
    try:
        check_bounds(config)
        if not config.print_launch:  # what this job writes, on this machine
            if config.checkpoint_dir is not None:
                check_writable_directory(config.checkpoint_dir, "--checkpoint-dir")
            if config.profile:
                check_writable_directory(config.run_dir or "runs", "--run-dir")
            if config.tensorboard is not None:
                require("tensorboard", "--tensorboard")
                check_writable_directory(config.tensorboard, "--tensorboard")
            if config.log_jsonl is not None:
                check_output_file(config.log_jsonl, "--log-jsonl")
    except OptionError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        world, per_node = _world_and_node_size(config)
        group_size(config.layout, config.shard_group_size, world, per_node)
    except ValueError as err:
        message = str(err).replace("shard_group_size=", "--shard-group-size ").replace("layout=", "--layout ")
        raise SystemExit(f"error: {message}") from None
    try:
        Wire.parse(config.wire)
    except ValueError as err:
        raise SystemExit(f"error: --{err}") from None
    if config.print_launch:
        return  # the rest is about this machine, not the cluster the command is for
    if (problem := worker.unavailable(config.backend)) is not None:
        raise SystemExit(f"error: {problem}")
    gpus = torch.cuda.device_count()
    if worker.uses_cuda(config.backend) and config.nproc is not None and config.nproc > gpus and not under_launcher():
        raise SystemExit(f"error: --nproc {config.nproc} asks for one GPU per worker, but {gpus} "
                         f"{'is' if gpus == 1 else 'are'} visible; use --nproc {gpus} or fewer")
    choice = _choice(config)
    if config.data is not None or config.tokenizer is not None:  # the default, the stdlib's sources, serves
        try:
            corpus = load_corpus(config.data, choice.seq_len, config.tokenizer, config.token_dtype)
            corpus.check_vocab(choice.vocab_size)
        except (OSError, ValueError) as err:  # a message not naming its option is about --data
            raise SystemExit(f"error: {err}" if str(err).startswith("--") else f"error: --data: {err}") from None


def _choice(config: TrainConfig) -> ModelChoice:
    try:
        return choose(config.model, units=config.units, seq_len=config.seq_len)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def _lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay for matrices (linear layers, embeddings), none for biases and norms, as nanoGPT
    decides: by the number of dimensions a parameter has in the model (``full_shape``; a sharded
    parameter itself is this rank's flat part)."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if len(p.full_shape) >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if len(p.full_shape) < 2], "weight_decay": 0.0},
    ]


def train(config: TrainConfig) -> None:
    """One worker's whole job; the process group ends with it, however it ends."""
    device = worker.worker_device(config.backend)
    with worker.process_group(device, datetime.timedelta(seconds=config.timeout)):
        _train(config, device, worker.backend_for(device))


def _train(config: TrainConfig, device: torch.device, backend: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    choice = _choice(config)
    corpus = load_corpus(config.data, choice.seq_len, config.tokenizer, config.token_dtype)

    torch.manual_seed(config.seed)
    model = choice.build().to(device)
    params = sum(p.numel() for p in model.parameters())
    shardwire.shard(
        model,
        units=list(choice.units),
        reshard_after_forward=config.reshard,
        prefetch=config.prefetch,
        layout=config.layout,
        shard_group_size=config.shard_group_size,
        wire=config.wire,
        mixed_precision=config.precision,
        activation_checkpointing=config.activation_checkpointing,
        timeout=config.timeout,
    )
    engine = engine_of(model)
    scaler = shardwire.GradScaler(model, enabled=config.precision == "fp16")  # passes through unless fp16
    # fused: one kernel over all parameters (torch's default for CPU tensors loops over them)
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95),
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))

    global_batch = config.batch * world
    rows = slice(rank * config.batch, (rank + 1) * config.batch)
    tokens_per_step = global_batch * config.grad_accum * choice.seq_len
    if rank == 0:
        print(
            f"shardwire train: {choice.name} ({params / 1e6:.2f}M parameters), "
            f"{world} ranks ({backend}, {device.type}), {len(engine.units)} block units + root, "
            f"layout {_describe_layout(engine)}, {_describe_wire(engine, config.wire)}, "
            f"prefetch {config.prefetch}, "
            f"{'reshard' if config.reshard else 'keep'} after forward, "
            f"{config.precision}; data: {corpus.name}, {corpus.num_tokens / 1e6:.1f}M tokens",
            flush=True,
        )
    start = _resume(config, model, optimizer, scheduler) if config.checkpoint_dir else 0
    profiler = _profiler(config, choice, model, optimizer, tokens_per_step) if config.profile else None
    progress = ProgressBar(config.steps, start=start) if rank == 0 else None
    scalars = ScalarLog(config.tensorboard, config.log_jsonl) if rank == 0 else None
    first_loss = last_loss = None
    interval_start, interval_steps = time.perf_counter(), 0
    started = time.perf_counter()

    loss_sum = torch.zeros((), device=device)  # over the steps since the last progress update
    for step in range(start, config.steps):
        model.train()
        with profiler.step() if profiler else contextlib.nullcontext(), engine.record() as records:
            for micro in range(config.grad_accum):
                batch = _to_device(corpus.batch(step * config.grad_accum + micro, global_batch,
                                                choice.seq_len, seed=config.seed, rows=rows), device)
                sync = micro == config.grad_accum - 1
                with contextlib.nullcontext() if sync else shardwire.no_sync(model):
                    loss = loss_fn(choice.logits(model, batch[:, :-1]), batch[:, 1:])
                    scaler.scale(loss / config.grad_accum).backward()
                loss_sum += loss.detach()
            scaler.unscale_(optimizer)
            if config.clip > 0:
                shardwire.clip_grad_norm_(model, config.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        interval_steps += 1

        val_loss = None
        if config.eval_every and (step + 1) % config.eval_every == 0:
            evaluating_from = time.perf_counter()
            val_loss = evaluate(model, choice, corpus, config, rows, global_batch, device)
            interval_start += time.perf_counter() - evaluating_from  # tokens/s counts training alone
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps or val_loss is not None:
            dist.all_reduce(loss_sum)
            last_loss = loss_sum.item() / (world * config.grad_accum * interval_steps)
            loss_sum.zero_()
            first_loss = last_loss if first_loss is None else first_loss
            step_time = (time.perf_counter() - interval_start) / interval_steps
            if progress is not None:
                summary = CommSummary.of(records, engine.comm.clock)  # the last step's; complete after item()
                fields = {
                    "loss": f"{last_loss:.3f}",
                    "tok/s": format_rate(tokens_per_step / step_time),
                    "comm": f"{summary.busy_s * 1e3:.0f}ms (exposed {summary.exposed_s * 1e3:.0f}ms)",
                }
                if val_loss is not None:
                    fields["val"] = f"{val_loss:.4f}"
                progress.update(step + 1, fields)
                values = {"loss": last_loss, "lr": scheduler.get_last_lr()[0],
                          "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                          "comm_s": summary.busy_s, "exposed_comm_s": summary.exposed_s}
                if val_loss is not None:
                    values["val_loss"] = val_loss
                if profiler is not None and "mfu" in (throughput := profiler.throughput(step_time)):
                    values["mfu"] = throughput["mfu"]
                scalars.write(step + 1, values)
            interval_start, interval_steps = time.perf_counter(), 0
        if config.checkpoint_dir and ((step + 1) % config.save_every == 0 or step + 1 == config.steps):
            saving_from = time.perf_counter()
            _save_checkpoint(config, model, optimizer, scheduler, step + 1)
            interval_start += time.perf_counter() - saving_from  # tokens/s counts training alone

    if progress is not None:
        progress.close()
        scalars.close()
    if profiler is not None and config.steps > start:
        _save_profile(profiler, config, rank)
    val_loss = evaluate(model, choice, corpus, config, rows, global_batch, device)
    if rank == 0:
        losses = f"loss {first_loss:.3f} -> {last_loss:.3f}, " if first_loss is not None else ""
        print(
            f"done: {config.steps - start} steps in {format_duration(time.perf_counter() - started)}, "
            f"{losses}validation loss {val_loss:.3f}",
            flush=True,
        )


def _resume(config: TrainConfig, model, optimizer, scheduler) -> int:
    """Restore the newest good checkpoint in --checkpoint-dir; returns the step to continue from."""
    try:
        info = shardwire.load_latest_checkpoint(config.checkpoint_dir, model, optimizer)
    except shardwire.CheckpointError as err:
        raise SystemExit(
            f"error: {err}\nRun with the settings these checkpoints were saved with, or another --checkpoint-dir."
        ) from None
    if info is None:
        return 0
    if not isinstance(info.extra, dict) or "scheduler" not in info.extra:
        raise SystemExit(f"error: {info.path} was not saved by shardwire train (it holds no learning-rate "
                         f"schedule); give --checkpoint-dir a directory of its own")
    if info.step > config.steps:
        raise SystemExit(f"error: {info.path} is at step {info.step}, past --steps {config.steps}: "
                         f"raise --steps to train on, or give another --checkpoint-dir")
    saved, current = info.extra["scheduler"], scheduler.state_dict()
    if (not isinstance(saved, dict) or not saved.keys() <= current.keys()
            or not all(fits(saved[key], current[key]) for key in saved) or saved.get("last_epoch") != info.step):
        raise SystemExit(f"error: {info.path} holds a learning-rate schedule that does not fit this run's, "
                         f"or is not at step {info.step}; give --checkpoint-dir a directory of its own")
    scheduler.load_state_dict(saved)
    if dist.get_rank() == 0:
        print(f"resuming from {info.path} (step {info.step}, saved by {info.world_size} ranks)", flush=True)
    return info.step


def _save_checkpoint(config: TrainConfig, model, optimizer, scheduler, step: int) -> None:
    """Save ``step`` into the series in --checkpoint-dir; the data position is the step itself."""
    shardwire.save_checkpoint(
        shardwire.checkpoint_path(config.checkpoint_dir, step), model, optimizer,
        step=step, extra={"scheduler": scheduler.state_dict()}, keep=config.keep or None,
    )


def _profiler(config: TrainConfig, choice: ModelChoice, model, optimizer, tokens_per_step: int) -> Profiler:
    flops = (flops_per_token(choice.spec, activation_checkpointing=config.activation_checkpointing)
             if choice.spec is not None else None)  # MFU needs an architecture the FLOP count knows
    counted = None
    if choice.runs_on_meta:
        with torch.device("meta"):  # torch's own count of the same model, as a cross-check
            meta_model = choice.build()
            tokens = torch.zeros(1, choice.seq_len + 1, dtype=torch.long)
        counted = torch_counted_flops_per_token(
            lambda: loss_fn(choice.logits(meta_model, tokens[:, :-1]), tokens[:, 1:]).backward(), choice.seq_len)
    metadata = {
        "model": config.model,
        "precision": config.precision,
        "config": dataclasses.asdict(config),
        "torch_counted_flops_per_token": counted,
    }
    return Profiler(model, optimizer, tokens_per_step=tokens_per_step, flops=flops,
                    peak_tflops=config.peak_tflops, metadata=metadata)


def _save_profile(profiler: Profiler, config: TrainConfig, rank: int) -> None:
    run_dir = config.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    summary = profiler.save(run_dir)
    if rank != 0:
        return
    f = {name: stats["max"] for name, stats in summary["figures"].items()}
    mfu = f"MFU {summary['mfu']:.1%}" if "mfu" in summary else "MFU unknown (no peak)"
    if summary.get("mfu", 0) > 1:
        mfu += " (above 100%: the probed peak is too low for this device and dtype; pass --peak-tflops)"
    print(
        f"profile: step {f['step_s'] * 1e3:.0f} ms on the slowest rank: forward {f['forward_s'] * 1e3:.0f}, "
        f"backward {f['backward_s'] * 1e3:.0f}, optimizer {f['optimizer_s'] * 1e3:.0f}, waiting for "
        f"communication {f['wait_s'] * 1e3:.0f} ms; communication {f['comm_s'] * 1e3:.0f} ms, "
        f"{summary['figures']['overlap_ratio']['median']:.0%} hidden; "
        f"{summary['model_tflops_per_worker']:.3f} TFLOP/s per worker, {mfu}\n"
        f"profile written to {run_dir} (shardwire report {run_dir} plots it)",
        flush=True,
    )


def _to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a batch to the GPU from pinned memory, without making the host wait for the copy."""
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model, choice: ModelChoice, corpus, config, rows, global_batch, device) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(config.eval_batches):
        batch = _to_device(corpus.batch(i, global_batch, choice.seq_len, seed=config.seed, split="val", rows=rows),
                           device)
        total += loss_fn(choice.logits(model, batch[:, :-1]), batch[:, 1:])
    dist.all_reduce(total)
    return total.item() / (config.eval_batches * dist.get_world_size())

