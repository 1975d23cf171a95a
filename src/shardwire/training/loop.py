"""The training loop behind ``shardwire train``: one worker's whole job, read top to bottom.

Build the model and shard it, build the optimizer and its schedule, resume from the newest
checkpoint, then step: micro-batches (all but the last under ``no_sync``), clipping, the optimizer,
and at its intervals the progress line, a validation loss and a checkpoint. With ``--plan``, a few
steps of the job as given are trained first and thrown away, to measure it
(``shardwire.training.autoplan``). Batches are a function of
the step (``shardwire.training.data``), so the step is the whole data position a checkpoint needs.
The settings are ``TrainConfig``'s; ``shardwire.cli.train`` checks them before any worker starts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import gc
import itertools
import math
import os
import pathlib
import shlex
import sys
import time
import warnings
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardwire
from shardwire import worker
from shardwire.comm.agreement import number
from shardwire.comm.wire import Wire
from shardwire.engine.checkpoint import CheckpointInfo, list_checkpoints
from shardwire.engine.checkpoint.series import prune, set_aside_in, step_of
from shardwire.engine.checkpoint.format import DirectoryMoved, Manifest
from shardwire.engine.checkpoint.schema import fits
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.shard import engine_of
from shardwire.engine.state_dict import weights_by_unit
from shardwire.files import Diverted, OutputRefused, StagedDirectory, results_in
from shardwire.launch import REFUSED, under_launcher
from shardwire.mappings import cut, one_line
from shardwire.models import fp8
from shardwire.models import tokenizer as hf_tokenizer
from shardwire.models.choice import (
    HF_PREFIX,
    ModelChoice,
    choose,
    config_difference,
    config_fields,
    recorded_name,
    tokenizer_directory,
)
from shardwire.models.export import save_pretrained
from shardwire.models.gpt import PRESETS, loss_fn
from shardwire.sim.gpt_sizes import BYTE_VOCAB
from shardwire.sim.specs import as_dict
from shardwire.profile.comm import CommSummary
from shardwire.profile.flops import flops_per_token, torch_counted_flops_per_token
from shardwire.profile.profiler import Profiler
from shardwire.options import SettingError, flag
from shardwire.training import autoplan
from shardwire.training.config import (TrainConfig, changed_settings, recorded_diloco, recorded_seq_len,
                                       training_settings)
from shardwire.training.deal import Deal, schedule_of
from shardwire.training.data import (
    MAX_SEED,
    TOKEN_SUFFIXES,
    ByteCorpus,
    DataChanged,
    TokenCorpus,
    data_change,
    load_corpus,
)
from shardwire.training.progress import ProgressBar, format_duration, format_rate, until_closed
from shardwire.training.scalars import ScalarLog


VALIDATION_SEED = 0  # validation batches are drawn alike in every run


def train(config: TrainConfig) -> None:
    """One worker's whole job; the process group ends with it, however it ends. What stops it from
    outside the loop (workers that cannot meet, data changed under it) is one line; a standard
    output that closes (``| head``) ends what it prints, not the run (``until_closed``). Rank 0
    claims the ``--export-hf`` directory before anything else, so that two runs given the same one
    do not both train to find it taken at the end."""
    export = None
    if config.export_hf and int(os.environ.get("RANK", "0")) == 0:
        try:
            export = StagedDirectory(config.export_hf, "--export-hf")
        except OutputRefused as err:
            raise SystemExit(f"error: {err}") from None
    try:
        with until_closed():
            _train_in_group(config, export)
    finally:
        if export is not None:
            export.discard()  # what is left of it where the run did not get to publish it


def _train_in_group(config: TrainConfig, export: StagedDirectory | None) -> None:
    device = worker.worker_device(config.backend)
    timeout = datetime.timedelta(seconds=config.timeout)
    try:
        worker.ensure_initialized(device, timeout)
    except dist.DistError as err:  # the store not reached, or not by every worker, within the timeout
        if "EADDRINUSE" in str(err):  # the first rank hosts the store at MASTER_PORT
            raise SystemExit(f"error: MASTER_PORT {os.environ.get('MASTER_PORT', '')[:10]} is in use by another "
                             f"process on this node, so the workers cannot meet there: free it, or choose another "
                             f"port (torchrun --master-port)") from None
        raise SystemExit(f"error: the workers did not meet within --timeout {config.timeout:g} seconds "
                         f"({str(err).splitlines()[0][:200]}): raise --timeout, or check that every node reaches "
                         f"the first one") from None
    with worker.process_group(device, timeout):
        try:
            planned = autoplan.plan_run(config, device, _probe) if config.plan != "none" else None
            _train(planned.config if planned else config, device, export, planned)
        except DataChanged as err:
            saved = config.checkpoint_dir is not None and list_checkpoints(config.checkpoint_dir)
            resumed = f" (it resumes from the newest checkpoint in {config.checkpoint_dir})" if saved else ""
            raise SystemExit(f"error: --data: {err}{resumed}") from None
        except SettingError as err:  # settings only the groups of a quorum can compare (fault tolerance)
            raise SystemExit(f"error: {err.as_options()}") from None
        except autoplan.PlanError as err:
            raise _agreed(f"error: {err}") from None


@dataclasses.dataclass
class _Job:
    """What a run trains: its model, built and sharded, the optimizer and its schedule, the data."""

    choice: ModelChoice
    corpus: ByteCorpus | TokenCorpus
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: shardwire.GradScaler
    params: int
    precision: str  # as the start line names it

    @property
    def engine(self):
        return engine_of(self.model)


def _build(config: TrainConfig, device: torch.device) -> _Job:
    """The model made from ``config.seed`` and sharded (a unit at a time where it is made on the meta
    device: no worker holds the whole model), its pretrained weights loaded, and its optimizer."""
    choice = choose(config.model, units=config.units, seq_len=config.seq_len)
    try:
        corpus = training_corpus(config, choice)
    except (ValueError, FileNotFoundError) as err:  # what the command checked before this worker started
        raise DataChanged(f"{err} (it changed as the run started)") from None

    torch.manual_seed(config.seed)
    if choice.init is not None:
        with torch.device("meta"):
            model = choice.build()
    else:
        model = choice.build().to(device)
    params = sum(p.numel() for p in model.parameters())
    precision = config.precision
    if config.precision == "fp8":
        try:
            precision = f"fp8 ({fp8.convert(model, choice.units)} linear layers)"
        except ValueError as err:
            raise SystemExit(f"error: --precision fp8: {err}") from None
    try:
        _shard(model, choice, config, device)
        if choice.load is not None:
            choice.load(model)
    except (ValueError, ConnectionError) as err:
        # what only the built model shows, a lighthouse out of reach: every rank meets it alike
        raise _agreed(f"error: {err}") from None
    scaler = shardwire.GradScaler(model, enabled=config.precision == "fp16")  # passes through unless fp16
    # fused: one kernel over all parameters (torch's default for CPU tensors loops over them)
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95),
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    return _Job(choice, corpus, model, optimizer, scheduler, scaler, params, precision)


def _step(job: _Job, config: TrainConfig, step: int, device: torch.device, diverged: _Divergence,
          loss_sum: torch.Tensor, deal: Deal | None = None) -> None:
    """One optimizer step: the micro-batches (all but the last under ``no_sync``), clipping, the
    optimizer and the schedule; each micro-batch's loss is added to ``loss_sum``, unless a failure
    dropped the step (fault-tolerant groups meeting at every step). Fault-tolerant groups read the
    blocks ``deal`` gave them, once they have met."""
    model, choice, world = job.model, job.choice, dist.get_world_size()
    rank, global_batch = dist.get_rank(), config.batch * world
    rows = slice(rank * config.batch, (rank + 1) * config.batch)  # this rank's share of each global batch
    losses = torch.zeros_like(loss_sum)
    for micro in range(config.grad_accum):
        dealt = deal.batch(micro, rows) if deal is not None else None
        batch = _to_device(dealt if dealt is not None else job.corpus.batch(
            step * config.grad_accum + micro, global_batch, choice.seq_len, seed=config.seed, rows=rows), device)
        last = micro == config.grad_accum - 1
        with contextlib.nullcontext() if last else shardwire.no_sync(model):
            loss = loss_fn(choice.logits(model, batch[:, :-1]), batch[:, 1:])
            job.scaler.scale(loss / config.grad_accum).backward()
        losses += loss.detach()
    diverged.note_loss(step, losses / config.grad_accum)  # the step's loss, as it is logged
    if job.engine.step_quorum is not None and not job.engine.step_quorum.committed:
        return  # a failure dropped the step for every fault-tolerant group: no gradients, no optimizer step
    loss_sum += losses
    job.scaler.unscale_(job.optimizer)
    if config.clip > 0:
        norm = shardwire.clip_grad_norm_(model, config.clip)
        if not job.scaler.is_enabled():  # under fp16 an overflowing step is skipped, not divergence
            diverged.note_norm(step, norm.to_local() if isinstance(norm, DTensor) else norm)
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)


def _probe(config: TrainConfig, device: torch.device, steps: int) -> dict[str, float]:
    """Train ``steps`` steps of ``config`` under the profiler and throw them away: the medians of rank
    0's forward, backward and optimizer over the steps after the first, on every rank."""
    job = _build(config, device)
    tokens_per_step = config.batch * dist.get_world_size() * config.grad_accum * job.choice.seq_len
    profiler = Profiler(job.model, job.optimizer, tokens_per_step=tokens_per_step, probe_peak=False)
    diverged, loss_sum = _Divergence(config, device), torch.zeros((), device=device)
    for step in range(steps):
        job.model.train()
        with profiler.step():
            _step(job, config, step, device, diverged, loss_sum)
    collected = profiler.collect()
    profiler.close()
    del job, profiler
    gc.collect()  # the probe's model and optimizer state, before the run builds its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    figures = [None]
    if collected is not None:
        summary = collected[0]["summary"]["figures"]
        figures = [{f"{phase}_s": summary[f"{phase}_s"]["median"] for phase in ("forward", "backward", "optimizer")}]
    dist.broadcast_object_list(figures, src=0)
    return figures[0]


def _train(config: TrainConfig, device: torch.device, export: StagedDirectory | None,
           planned: autoplan.Planned | None = None) -> None:
    """``export``: rank 0's stage of the ``--export-hf`` directory (``train``); ``planned``: what
    ``--plan`` chose and predicted, checked against the steps measured."""
    rank, world = dist.get_rank(), dist.get_world_size()
    job = _build(config, device)
    choice, corpus, model, optimizer, scheduler = job.choice, job.corpus, job.model, job.optimizer, job.scheduler
    engine = job.engine
    quorum = engine.layout.quorum
    meeting = engine.outer if engine.outer is not None else engine.step_quorum  # where groups meet, if they do
    global_batch = config.batch * world
    deal = None
    if quorum is not None:
        # The groups' data dealt among them at each meeting, in an order drawn from the shared seed.
        # Groups averaging gradients at every step stay one model only stepping alike; under DiLoCo each
        # steps its own way between syncs.
        stepping = None if engine.outer is not None else (
            f"--lr {number(config.lr)!r} --warmup {config.warmup} "
            f"--weight-decay {number(config.weight_decay)!r} --clip {number(config.clip)!r}")
        ending = schedule_of(config.steps, config.eval_every, diloco=engine.outer is not None)
        deal = Deal(quorum, meeting, corpus, batch=global_batch, grad_accum=config.grad_accum, seq_len=choice.seq_len,
                    seed=config.seed, schedule=ending, data=corpus.identity, training=stepping)
        # Each group its own random draws (only where it holds no blocks) and its own checkpoints.
        config = dataclasses.replace(
            config, seed=zlib.crc32(f"{config.seed}/{quorum.settings.group}".encode()) % (MAX_SEED + 1),
            checkpoint_dir=config.checkpoint_dir and os.path.join(config.checkpoint_dir, quorum.settings.group))
    shardwire.recover_with(model, optimizer=optimizer, scheduler=scheduler, scaler=job.scaler)

    rows = slice(rank * config.batch, (rank + 1) * config.batch)  # this rank's share of each global batch
    trained_on = _trained_on(config, corpus, global_batch)
    tokens_per_step = global_batch * config.grad_accum * choice.seq_len
    if rank == 0:
        print(f"shardwire train: {choice.name} ({job.params / 1e6:.2f}M parameters), {world} rank{'s' * (world > 1)} "
              f"({worker.backend_for(device)}, {device.type}), {len(engine.units)} block units + root, "
              f"layout {_describe_layout(engine)}, {_describe_wire(engine, config.wire)}, "
              f"prefetch {config.prefetch}, {'reshard' if config.reshard else 'keep'} after forward, "
              f"{job.precision}; data: {one_line(corpus.description)}", flush=True)
        if choice.note is not None:
            print(f"note: {choice.note}", file=sys.stderr, flush=True)
    start = (_resume(config, model, optimizer, scheduler, trained_on, choice.seq_len, deal) if config.checkpoint_dir
             else 0)
    if engine.outer is not None and quorum is not None:
        if start < config.steps:
            engine.outer.join()  # meet the other groups: one behind takes their state here
            start = engine.outer.steps
        else:  # nothing to train: the groups' final model stays theirs
            engine.outer.stay_apart()
    # the model the run starts from, on the validation split the final model is judged on (``_Divergence``)
    start_val_loss = evaluate(model, choice, corpus, config, rows, global_batch, device) if start < config.steps \
        else None
    profiler = _profiler(config, choice, model, optimizer, tokens_per_step) if config.profile else None
    log = _IntervalLog(config, start, tokens_per_step) if rank == 0 else None
    loss_sum = torch.zeros((), device=device)  # over the steps since the last log line
    diverged = _Divergence(config, device, start, start_val_loss)
    interval_start, interval_steps, losses, val_loss = time.perf_counter(), 0, [], None
    started = time.perf_counter()

    check = autoplan.StepCheck(planned, start, config.steps, device) if planned is not None else None
    step, trained = start, 0  # trained: the steps this run took, not those a recovery moved it past
    while step < config.steps:
        model.train()
        if check is not None:
            check.starting(step)
        with profiler.step() if profiler else contextlib.nullcontext(), engine.record() as records:
            if deal is not None:  # meet before this step's data is dealt (one behind takes the others' state)
                meeting.before_forward()
            _step(job, config, step, device, diverged, loss_sum, deal)
        if engine.step_quorum is not None and not engine.step_quorum.committed:
            continue  # a failure dropped the step for every group: it runs again, its data dealt again
        if check is not None:
            check.ended(step)
        trained += 1
        if quorum is not None:  # a group that was behind took the others' step at this step's quorum
            step = min(meeting.steps, config.steps) - 1
        interval_steps += 1
        if step + 1 == config.steps:
            shardwire.diloco_sync(model)  # groups that sync every H steps end as one model, saved as one

        val_loss = None  # at --eval-every, and at the last step: the run's result, recorded with it
        if step + 1 == config.steps or (config.eval_every and (step + 1) % config.eval_every == 0):
            paused = time.perf_counter()
            val_loss = evaluate(model, choice, corpus, config, rows, global_batch, device)
            interval_start += time.perf_counter() - paused  # tokens/s counts training alone
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps or val_loss is not None:
            diverged.check()
            dist.all_reduce(loss_sum)  # reading it waits for the device: once per interval
            losses.append(loss_sum.item() / (world * config.grad_accum * interval_steps))
            diverged.logged(step + 1, losses[-1])
            loss_sum.zero_()
            step_time = (time.perf_counter() - interval_start) / interval_steps
            synced = meeting.metrics() if meeting is not None else {}  # every rank takes part
            if log is not None:
                log.interval(step + 1, losses[-1], val_loss, step_time, scheduler.get_last_lr()[0],
                             CommSummary.of(records, engine.comm.clock), profiler, synced)
            interval_start, interval_steps = time.perf_counter(), 0
        if config.checkpoint_dir and ((step + 1) % config.save_every == 0 or step + 1 == config.steps):
            paused = time.perf_counter()
            diverged.check()  # a diverged model is never saved, so it never prunes a finite one
            if deal is not None and engine.outer is not None:
                engine.outer.settle()  # a sync in flight is applied and voted on first, as the save would: its deal too
            groups = {} if deal is None else {"deal": deal.state(), "groups_met": quorum.most_met}
            diverged.saved(_save_checkpoint(config, model, optimizer, scheduler, step + 1, {**trained_on, **groups}))
            interval_start += time.perf_counter() - paused
        step += 1

    if log is not None:
        log.close()
    if profiler is not None and config.steps > start:
        _save_profile(profiler, config, rank)
    if val_loss is None:  # no step trained: the model resumed is the one the run ends with
        val_loss = evaluate(model, choice, corpus, config, rows, global_batch, device)
    diverged.vouched(val_loss)
    if rank == 0:
        # from the first step's loss (the first logged is a mean over --log-every steps) to the last logged
        trend = f"loss {diverged.first_loss:.3f} -> {losses[-1]:.3f}, " if losses else ""
        print(f"done: {trained} steps in {format_duration(time.perf_counter() - started)}, "
              f"{trend}validation loss {val_loss:.3f}", flush=True)
        if quorum is not None and 0 < quorum.met < quorum.most_met:  # 0: no meeting, nothing trained
            print(f"warning: this group's final sync met {quorum.met} group(s), where {quorum.most_met} met before: "
                  f"the groups do not end as one model (a group was lost for good, or ended before this one); "
                  f"export each group's series and compare them before using one", file=sys.stderr, flush=True)
    if config.export_hf:
        weights = weights_by_unit(model)  # gathered a unit at a time, every rank taking part
        try:
            if rank == 0:
                try:
                    tokenizer = run_tokenizer(config)
                    written = save_pretrained(config.model, weights, export, fields=trained_on.get("hf_config"),
                                              tokenizer=tokenizer[0] if tokenizer else False)
                except Diverted as err:  # written whole, beside a directory made there since the run began
                    raise SystemExit(f"error: {err}") from None
                except OSError as err:  # a full disk, a quota: the run's other results stand
                    raise SystemExit(f"error: --export-hf {config.export_hf}: {err.strerror or err}; "
                                     f"{_where_the_model_is(config)}") from None
                print(one_line(f"exported to {written} (from_pretrained loads it)"), flush=True)
        except KeyboardInterrupt:
            raise  # a stop, which every rank's launcher sends it: no rank is left waiting in a gather
        except BaseException:
            weights.take_part()  # the gathers the writer did not reach, so that no rank waits for ever
            raise
        weights.take_part()


def _where_the_model_is(config: TrainConfig) -> str:
    """Where the trained model is kept, when its export could not be written: the checkpoint of the
    last step, which every run with --checkpoint-dir saves."""
    last = config.checkpoint_dir and shardwire.checkpoint_path(config.checkpoint_dir, config.steps)
    if not last or not last.is_dir():
        return "the trained model was not kept (no --checkpoint-dir)"
    return f"the trained model is in {last}: `shardwire export {shlex.quote(str(last))} DIR` writes it elsewhere"


def _shard(model: torch.nn.Module, choice: ModelChoice, config: TrainConfig, device: torch.device) -> None:
    shardwire.shard(
        model,
        device=device,
        init=choice.init(model) if choice.init is not None else None,
        units=list(choice.units),
        reshard_after_forward=config.reshard,
        prefetch=config.prefetch,
        layout=config.layout,
        shard_group_size=config.shard_group_size,
        wire=config.wire,
        diloco=config.diloco,
        fault_tolerance=config.fault_tolerance,
        mixed_precision="bf16" if config.precision == "fp8" else config.precision,
        activation_checkpointing=config.activation_checkpointing,
        compile=config.compile,
        timeout=config.timeout,
    )


def run_tokenizer(config: TrainConfig) -> tuple[pathlib.Path, str] | None:
    """The tokenizer of the run's text, and of what it exports, with how the user gave it: ``--tokenizer``,
    else the ``hf:`` model directory's own where it holds one."""
    if config.tokenizer is not None:
        return pathlib.Path(config.tokenizer), f"--tokenizer {config.tokenizer}"
    if (own := tokenizer_directory(config.model)) is not None:
        return own, f"the tokenizer in {config.model}"
    return None


def training_corpus(config: TrainConfig, choice: ModelChoice, memory: int | None = None) -> ByteCorpus | TokenCorpus:
    """The job's data: token ids as they are; text through ``--tokenizer``, else through the ``hf:``
    model's own tokenizer where its directory holds one; text as bytes only into a model whose ids
    mean bytes (a GPT preset, or a Hugging Face model with a vocabulary of 256), and refused where it
    needs more than ``memory`` bytes; a tokenizer with more ids than the model's vocabulary is refused
    before it tokenises anything. Its batches hold ids of the vocabulary only (``TokenCorpus.vocab_size``)."""
    text = not (config.data or "").endswith(TOKEN_SUFFIXES)
    tokenizer = run_tokenizer(config) if text or config.tokenizer is not None else None  # ids need none given
    corpus = load_corpus(config.data, choice.seq_len, tokenizer and str(tokenizer[0]), config.token_dtype, memory,
                         tokenizer and tokenizer[1], choice.vocab_size)
    if isinstance(corpus, ByteCorpus) and config.model.startswith(HF_PREFIX) and choice.vocab_size != BYTE_VOCAB:
        raise ValueError(f"--data is text, read as bytes (ids 0 to 255), but {choice.name}'s {choice.vocab_size:,} "
                         f"ids are its tokenizer's: give --tokenizer DIR (its tokenizer) or pre-tokenised --data")
    return corpus


@torch.no_grad()
def evaluate(model, choice: ModelChoice, corpus, config: TrainConfig, rows: slice, global_batch: int,
             device: torch.device) -> float:
    """The mean loss over ``--eval-batches`` batches of the validation split, over every rank: the same
    batches whatever ``--seed`` (runs that differ in seed differ in the model alone), of the global
    model where groups sync every H steps (the anchor they last agreed on, after the sync due now)."""
    model.eval()
    total = torch.zeros((), device=device)
    with shardwire.global_model(model):
        for i in range(config.eval_batches):
            batch = corpus.batch(i, global_batch, choice.seq_len, seed=VALIDATION_SEED, split="val", rows=rows)
            batch = _to_device(batch, device)
            total += loss_fn(choice.logits(model, batch[:, :-1]), batch[:, 1:])
    dist.all_reduce(total)
    return total.item() / (config.eval_batches * dist.get_world_size())


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay for matrices (linear layers, embeddings), none for biases and norms, as nanoGPT
    decides: by the number of dimensions a parameter has."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a batch to the GPU from pinned memory, without making the host wait for the copy."""
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def _agreed(message: str) -> SystemExit:
    """The stop of a run that every rank reaches alike (a check of the checkpoint it resumes, agreed
    by every rank; a divergence, found by an all-reduce): under a launcher rank 0 says why before
    any rank leaves (the launcher stops the rest as the first exits), and every rank leaves with the
    status of a refusal, so that it is one line however many workers there are."""
    if not under_launcher():
        return SystemExit(message)
    if dist.get_rank() == 0:
        print(one_line(message), file=sys.stderr, flush=True)
    dist.barrier()
    return SystemExit(REFUSED)


def _describe_layout(engine) -> str:
    layout = engine.layout
    if layout.quorum is not None:
        meeting = f"diloco {layout.diloco}" if layout.diloco is not None else "gradients averaged at every step"
        return f"hybrid (fault-tolerant group {layout.quorum.settings.group!r} of {layout.shard.world}, {meeting})"
    plan = layout.plan
    if plan.replicated:
        synced = "" if layout.diloco is None else f", diloco {layout.diloco}"
        return f"hybrid ({plan.groups} group{'s' if plan.groups > 1 else ''} of {plan.group}{synced})"
    if plan.keeps_secondary:
        return f"hybrid_secondary (backward within groups of {plan.group})"
    return "full" if plan.name == "full" else f"{plan.name} in one group (as full)"


def _describe_wire(engine, wire: str) -> str:
    wire = Wire.parse(wire)
    if wire.quantized and engine.comm.placement.nodes == 1:
        if engine.step_quorum is not None and wire.grads is not None:  # fault-tolerant groups are nodes apart
            return f"wire {wire} (gradients quantized between the groups; nothing within this group's node)"
        return f"wire {wire} (unused: all ranks share a node, and only what crosses nodes is quantized)"
    return f"wire {wire}"


class _Divergence:
    """The first step whose loss or gradient norm was not finite, or whose loss spiked: above
    ``SPIKE_FACTOR`` times the mean of the last ``SPIKE_WINDOW`` losses logged after warmup, and
    until that many are, above ``SPIKE_FACTOR`` times the run's first loss, that of the model it
    started from (fresh, or the checkpoint it resumed), so that a run diverging in its first steps,
    or at once on resuming with another ``--lr``, is stopped too; a bound below ``SPIKE_FACTOR``
    is raised to it, as a loss near 0 varies by more than its multiple. A loss that jumps from 5.5
    to 102,258 is finite, but the model it came from no longer trains, and saving it would prune
    the checkpoints before it. Kept on the device (a host sync per step would stall a GPU) and read
    where the loop waits for the device anyway: before a log line and before a checkpoint. Ranks
    see different losses, so they agree on the earliest before any decides to stop. The message
    names the optimizer whose step came before: the outer one of ``--diloco`` at the step after an
    outer step, the inner one before any outer step, else either.

    A loss can also climb or stay high without a spike, each logged mean within bounds of the last
    (an outer learning rate of 10, an inner one of 1): the run is stopped as diverged once the mean
    of the last ``SPIKE_WINDOW`` logged losses is over ``CLIMB_FACTOR`` times the lowest such mean
    of the run, or the loss of the model it started from (and a nat above it, as a loss near 0
    doubles by noise alone), and its checkpoints saved after that lowest point are moved out of the
    series. While the loss is above its lowest, the ``--keep`` checkpoints saved at or before the
    lowest point (or, where that is the fresh model's, the first saved) are spared by ``--keep``, so
    that a climb leaves as many as ``--keep`` promised. Only logged losses are
    judged: a run that logs seldom (``--log-every`` beside ``--steps``) has few to judge a climb by.

    A checkpoint's weights are vouched for only by the loss computed from them, at the step after
    it (or, for the last, by the validation loss after the run's final sync, which must also be
    within a nat of the model's the run started from, where the training loss did not fall:
    ``_final_problem``): the run keeps one
    checkpoint more than ``--keep`` until then (``vouched``), and a checkpoint of this run saved
    from weights that then diverged is moved out of the series, so that a resume never starts from
    it."""

    SPIKE_FACTOR = 10
    SPIKE_WINDOW = 5
    CLIMB_FACTOR = 2

    def __init__(self, config: TrainConfig, device: torch.device, start: int = 0, start_val_loss: float | None = None):
        self._config = config
        self._start = start
        self._start_val_loss = start_val_loss  # the validation loss of the model the run started from
        self._start_train_loss: float | None = None  # its training loss, over every rank (``logged``)
        self._last_logged: float | None = None  # the last logged loss
        self._diloco = DiLoCo.parse(config.diloco)
        self._never = config.steps
        self._first = torch.full((2,), self._never, dtype=torch.long, device=device)  # not finite, spiked
        self._device = device
        self._limit: torch.Tensor | None = None  # set by the first loss, on the device
        self._basis = "the run's first loss"
        self._recent: collections.deque[float] = collections.deque(maxlen=self.SPIKE_WINDOW)  # after warmup
        self._climbing: collections.deque[float] = collections.deque(maxlen=self.SPIKE_WINDOW)  # warmup's too
        self._saved: list[pathlib.Path] = []  # this run's checkpoints, oldest first
        self._start_loss: torch.Tensor | None = None  # this rank's first loss, on the device
        self._lowest: tuple[float, int] | None = None  # the lowest loss (a windowed mean, or the first), its step

    def note_loss(self, step: int, loss: torch.Tensor) -> None:
        if self._limit is None:
            self._start_loss = loss.clone()
            self._limit = self.SPIKE_FACTOR * loss.clamp(min=1.0)  # not finite stays so, and never bounds
        self._note(0, step, torch.isfinite(loss))
        self._note(1, step, loss <= self._limit)

    @property
    def first_loss(self) -> float | None:
        """The loss of the run's first step, over every rank, once a loss was logged (None before)."""
        return self._start_train_loss

    def note_norm(self, step: int, norm: torch.Tensor) -> None:
        self._note(0, step, torch.isfinite(norm))

    def _note(self, kind: int, step: int, fine: torch.Tensor) -> None:
        first = self._first[kind]
        self._first[kind] = torch.where(fine | (first < self._never), first, step)

    def logged(self, step: int, loss: float) -> None:
        """The mean loss of the interval that ended at ``step`` (every rank's, after ``check``)."""
        if self._lowest is None and self._start_loss is not None:  # the start's loss, over every rank
            start_loss = self._start_loss.clone()
            dist.all_reduce(start_loss)
            self._lowest = (start_loss.item() / dist.get_world_size(), self._start)
            self._start_train_loss = self._lowest[0]
        self._last_logged = loss
        self._climbing.append(loss)
        if len(self._climbing) == self.SPIKE_WINDOW:
            self._check_climb(step, sum(self._climbing) / self.SPIKE_WINDOW)
        if step <= self._config.warmup:
            return
        self._recent.append(loss)
        if len(self._recent) == self.SPIKE_WINDOW:
            mean = sum(self._recent) / self.SPIKE_WINDOW
            self._limit = torch.tensor(self.SPIKE_FACTOR * max(1.0, mean), device=self._device)
            self._basis = f"the mean of the last {self.SPIKE_WINDOW} logged losses"

    def _check_climb(self, step: int, mean: float) -> None:
        """Stop the run where ``mean``, of the last logged losses (warmup's too: a learning rate far too
        high climbs there as well), has climbed far above the lowest loss of the run."""
        if self._lowest is None or mean < self._lowest[0]:
            self._lowest = (mean, step)
            return
        lowest, at = self._lowest
        if mean > max(self.CLIMB_FACTOR * lowest, lowest + 1):
            what = (f"their lowest, {lowest:.4g} at step {at}" if at > self._start
                    else f"the loss of the model the run started from, {lowest:.4g}")
            diloco = self._diloco
            remedy = f"lower --lr (now {self._config.lr:g})"
            if diloco is not None:
                remedy += (f", or the outer step's --diloco outer_lr (now {diloco.outer_lr:g}) or momentum "
                           f"(now {diloco.momentum:g})")
            raise _agreed(f"error: training diverged: the mean of the last {self.SPIKE_WINDOW} logged losses climbed "
                          f"to {mean:.4g} at step {step}, "
                          f"over {self.CLIMB_FACTOR} times {what} "
                          f"({self._set_aside(at + 1)}): {remedy}")

    def check(self) -> None:
        """Stop the run, with what to change, once a step has diverged."""
        dist.all_reduce(self._first, op=dist.ReduceOp.MIN)
        not_finite, spiked = self._first.tolist()
        if (step := min(not_finite, spiked)) >= self._never:
            return
        if not_finite <= spiked:
            what = "the loss or the gradient norm was not finite"
        else:
            what = f"the loss was above {self._limit.item():.3g}, {self.SPIKE_FACTOR} times {self._basis},"
        raise _agreed(f"error: training diverged: {what} at step {step + 1} ({self._set_aside(step)}): "
                      f"{self._remedy(step)}")

    def saved(self, checkpoint: pathlib.Path) -> None:
        """This run saved ``checkpoint``, whose weights the next loss vouches for: the series keeps one
        more than ``--keep`` until it does, and the ``--keep`` checkpoints at the lowest loss beside them."""
        self._saved.append(checkpoint)
        if self._config.keep and dist.get_rank() == 0:
            try:
                prune(checkpoint, self._config.keep + 1, spare=self._at_lowest(checkpoint.parent))
            except OSError as err:  # the checkpoint itself is saved
                warnings.warn(f"checkpoint {checkpoint} is saved, but pruning its series failed: {err}", stacklevel=2)

    def _at_lowest(self, series: pathlib.Path) -> list[pathlib.Path]:
        """The ``--keep`` newest checkpoints in ``series`` of weights from no later than the run's lowest
        loss (the one it resumed among them, where its loss has only been higher since), or, where none
        is (the lowest is the fresh model's, before any save), the oldest after it: the nearest to the
        lowest there is, where a run that logs seldom has too few losses to place it better. A climb
        sets aside every checkpoint saved after the lowest, so these are the ones ``--keep`` leaves
        then; until it does, each save leaves the series at most twice ``--keep`` and one."""
        if self._lowest is None:
            return []
        saved = list_checkpoints(series)
        before = [path for path in saved if step_of(path) <= self._lowest[1]]
        return before[-self._config.keep:] if before else saved[:1]

    def vouched(self, val_loss: float) -> None:
        """After the run: the validation loss of its final model (after the final sync of
        ``--diloco``, which no training loss follows) vouches for its last checkpoint, and the
        series is pruned to ``--keep``; or the run stops as diverged at its last step."""
        what = self._final_problem(val_loss)
        if what is None:
            if self._saved and self._config.keep:
                if dist.get_rank() == 0:
                    prune(self._saved[-1], self._config.keep)
                dist.barrier()  # the ranks end together, none left inside a collective while rank 0 deletes
            return
        if self._diloco is None:
            remedy = self._remedy(self._config.steps)
        else:
            remedy = (f"the run's final sync took an outer step: lower --diloco outer_lr (now "
                      f"{self._diloco.outer_lr:g}) or momentum (now {self._diloco.momentum:g}); or, where the loss "
                      f"had risen over the inner steps before it, lower --lr (now {self._config.lr:g}) or raise "
                      f"--warmup (now {self._config.warmup})")
        raise _agreed(f"error: training diverged: the validation loss after the last step was {val_loss:.4g}, "
                      f"{what} ({self._set_aside(self._config.steps)}): {remedy}")

    def _final_problem(self, val_loss: float) -> str | None:
        """How the final model's validation loss shows it diverged, or None: not finite or above the
        spike bound, or over a nat above the validation loss of the model the run started from while
        its training loss ended no lower than it began (a loss that climbed in the last steps, too
        late for a logged mean to show it: a model worse than the one it started from by that much,
        on both splits, has stopped training). Validation against validation: the training split's
        loss can lie far below it (other text); and training with it: a model fine-tuned away from
        text like the validation split's trains on. The same verdict on every rank (the losses are
        every rank's)."""
        limit = self._limit.clone() if self._limit is not None else torch.tensor(math.inf, device=self._device)
        dist.all_reduce(limit, op=dist.ReduceOp.MAX)  # the loosest rank's bound: every rank decides alike
        start, began, ended = self._start_val_loss, self._start_train_loss, self._last_logged
        if not (math.isfinite(val_loss) and val_loss <= limit.item()):
            return f"above {limit.item():.3g}, {self.SPIKE_FACTOR} times {self._basis}"
        if start is not None and val_loss > start + 1 and began is not None and ended is not None and ended >= began:
            return (f"over a nat above that of the model the run started from, {start:.4g}, and its training loss "
                    f"ended at {ended:.4g}, no lower than it began ({began:.4g})")
        return None

    def _set_aside(self, step: int) -> str:
        """Move this run's checkpoints of weights from ``step`` on (counted from 0: the weights of
        checkpoint ``step`` gave that step's loss) out of the series, on rank 0; says what the series
        holds now."""
        suspect = [path for path in self._saved if step_of(path) >= step and path.is_dir()]  # not pruned since
        aside = [_free_name(path.with_name(f"{path.name}.diverged")) for path in suspect]
        if dist.get_rank() == 0:
            for path, target in zip(suspect, aside):
                path.rename(target)  # within its directory: a rename, never a copy
        dist.barrier()  # every rank lists the series as rank 0 left it
        series = list_checkpoints(self._config.checkpoint_dir) if self._config.checkpoint_dir else []
        newest = f"{series[-1]} is the newest checkpoint" if series else "no checkpoint is left in the series"
        if not suspect:
            return f"{newest}, and nothing after it was saved" if series else "nothing was saved"
        return (f"{newest}: the weights saved after it had diverged, and were moved out of the series as "
                f"{', '.join(target.name for target in aside)}")

    def _remedy(self, step: int) -> str:
        """What to change where ``step`` (counted from 0) diverged: the outer optimizer's settings first
        where an outer step of ``--diloco`` was applied as it began (the sync due after ``step -
        fragment_sync_delay`` inner steps), then the inner's, as an outer step applies what the inner
        steps before it moved (a learning rate far too high doubles the loss before the first outer
        step, which the outer momentum then carries over the bound); the inner optimizer's where none
        was applied before it; else either's, as a loss that climbs across outer steps crosses the
        bound at an inner step as often as not, whichever optimizer drove it there."""
        inner = f"lower --lr (now {self._config.lr:g}) or raise --warmup (now {self._config.warmup})"
        diloco = self._diloco
        if diloco is None:
            return inner
        outer = f"--diloco outer_lr (now {diloco.outer_lr:g}) or momentum (now {diloco.momentum:g})"
        applied = [at for at in range(step + 1) if diloco.due(at - diloco.fragment_sync_delay) is not None]
        if applied and applied[-1] == step:
            return (f"it came at the step after an outer step: lower {outer}; or, where the loss had "
                    f"risen over the inner steps before it, {inner}")
        if applied:
            return f"{inner}; or, as it came after outer steps, lower {outer}"
        return inner


def _free_name(path: pathlib.Path) -> pathlib.Path:
    """``path``, or with a number added where that name is taken (a checkpoint set aside before)."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


class _IntervalLog:
    """Rank 0's record of each log interval: the progress line and the scalars (``--tensorboard``,
    ``--log-jsonl``)."""

    def __init__(self, config: TrainConfig, start: int, tokens_per_step: int):
        self._progress = ProgressBar(config.steps, start=start)
        self._scalars = ScalarLog(config.tensorboard, config.log_jsonl)
        self._tokens_per_step = tokens_per_step
        self._eval_every = config.eval_every

    def interval(self, step: int, loss: float, val_loss: float | None, step_time: float, lr: float,
                 comm: CommSummary, profiler: Profiler | None, synced: dict[str, float]) -> None:
        """Show and record the interval that ended at ``step`` (``comm``: its last step's collectives;
        ``synced``: what its syncs did, where groups sync every H steps)."""
        fields = {"loss": f"{loss:.3f}", "tok/s": format_rate(self._tokens_per_step / step_time),
                  "comm": f"{comm.busy_s * 1e3:.0f}ms (exposed {comm.exposed_s * 1e3:.0f}ms)"}
        values = {"loss": loss, "lr": lr, "tokens_per_s": self._tokens_per_step / step_time,
                  "step_time_s": step_time, "comm_s": comm.busy_s, "exposed_comm_s": comm.exposed_s}
        if val_loss is not None:  # shown at --eval-every: the last step's is the run's last line's
            values["val_loss"] = val_loss
            if self._eval_every and step % self._eval_every == 0:
                fields["val"] = f"{val_loss:.4f}"
        if synced:
            fields["sync"] = _describe_syncs(synced)
            values.update({f"sync_{name}": value for name, value in synced.items()})
        if profiler is not None and "mfu" in (throughput := profiler.throughput(step_time)):
            values["mfu"] = throughput["mfu"]
        self._progress.update(step, fields)
        self._scalars.write(step, values)

    def close(self) -> None:
        self._progress.close()
        self._scalars.close()


def _describe_syncs(synced: dict[str, float]) -> str:
    """What the interval's syncs did: the outer gradient's norm and the groups' drift, or, between
    fault-tolerant groups, the groups of the last sync and the syncs a failure dropped or that
    brought this group the others' state (how many steps on, and how many bytes)."""
    found = [f"outer grad {synced['outer_grad_norm']:.3g}"] if "outer_grad_norm" in synced else []
    if "drift" in synced:
        found.append(f"drift {synced['drift']:.3g}")
    if "groups" in synced:
        found.append(f"{synced['groups']} group{'' if synced['groups'] == 1 else 's'}")
        if synced["dropped"]:
            found.append(f"{synced['dropped']} dropped")
        if synced["recovered"]:
            found.append(f"{synced['recovered']} recovered ({synced['skipped_steps']} steps on, "
                         f"{synced['recovery_bytes'] / 1e6:.3g} MB received)")
    return ", ".join(found)


def _trained_on(config: TrainConfig, corpus: ByteCorpus | TokenCorpus, global_batch: int) -> dict:
    """What each checkpoint records of what this run trains, beside its settings, for a resume to
    name what changed: the data's identity, the global batch (``--batch`` is per rank, so a change of
    world size changes it) and, for an ``hf:`` model, its config as the run read it (the trained
    weights belong to that architecture; ``shardwire export`` builds the model from it)."""
    recorded = {"data": corpus.identity, "global_batch": global_batch}
    if (fields := config_fields(config.model)) is not None:
        recorded["hf_config"] = fields
    if (tokenizer := run_tokenizer(config)) is not None:
        recorded["tokenizer"] = {"path": str(tokenizer[0].resolve()), "digest": hf_tokenizer.digest_of(tokenizer[0])}
    return recorded


def _tokenizer_change(recorded: object, now: dict | None) -> str | None:
    """How the run's tokenizer differs from the one a checkpoint ``recorded``, where its files do:
    "the tokenizer" where the run gives another (its option is named as changed), its files where
    the same directory's changed since."""
    if not isinstance(recorded, dict) or now is None or recorded.get("digest") == now["digest"]:
        return None
    if recorded.get("path") == now["path"] and hf_tokenizer.holds(now["path"], recorded.get("digest")):
        return None  # recorded as earlier versions did, of every file beside the tokenizer's too
    return f"the files of the tokenizer in {now['path']}" if recorded.get("path") == now["path"] else "the tokenizer"


def _resume(config: TrainConfig, model, optimizer, scheduler, trained_on: dict, seq_len: int,
            deal: Deal | None = None) -> int:
    """Restore the newest good checkpoint in --checkpoint-dir, and the data ``deal`` of
    fault-tolerant groups; returns the step to continue from."""
    if (another := trained_otherwise(config, seq_len)) is not None:
        raise _agreed(f"error: {another}")
    try:
        info = shardwire.load_latest_checkpoint(config.checkpoint_dir, model, optimizer)
    except shardwire.CheckpointError as err:
        raise _agreed(f"error: {err}") from None
    if info is None:
        if dist.get_rank() == 0 and (aside := set_aside_in(config.checkpoint_dir)):  # a rerun after a divergence
            names = ", ".join(aside[:3]) + (f" and {len(aside) - 3} more" if len(aside) > 3 else "")
            print(f"note: {config.checkpoint_dir} holds no checkpoint to resume from, only ones set aside ({names}): "
                  f"this run starts from the beginning", file=sys.stderr, flush=True)
        return 0
    if not isinstance(info.extra, dict) or "scheduler" not in info.extra:
        raise _agreed(f"error: {info.path} was not saved by shardwire train (it holds no learning-rate "
                         f"schedule); give --checkpoint-dir a directory of its own")
    if info.step > config.steps:
        raise _agreed(f"error: {info.path} is at step {info.step}, past --steps {config.steps}: "
                         f"raise --steps to train on, or give another --checkpoint-dir")
    saved, current = info.extra["scheduler"], scheduler.state_dict()
    if (not isinstance(saved, dict) or not saved.keys() <= current.keys()
            or not all(fits(saved[key], current[key]) for key in saved) or saved.get("last_epoch") != info.step):
        raise _agreed(f"error: {info.path} holds a learning-rate schedule that does not fit this run's, "
                         f"or is not at step {info.step}; give --checkpoint-dir a directory of its own")
    scheduler.load_state_dict(saved)
    _set_hyperparameters(config, optimizer, scheduler, info.step)
    if deal is not None:
        try:
            deal.load_state(info.extra.get("deal"))
        except ValueError as err:
            raise _agreed(f"error: {info.path}: {err}; give --checkpoint-dir a directory of its own") from None
        # the most groups that met before the restart: one that comes back after the others ended,
        # and syncs alone, says so at its end as the run it resumes would have
        if isinstance(met := info.extra.get("groups_met"), int) and not isinstance(met, bool):
            quorum = engine_of(model).layout.quorum
            quorum.most_met = max(quorum.most_met, met)
    _check_architecture(config, info, trained_on.get("hf_config"))
    data = data_change(info.extra.get("data"), trained_on["data"],
                       _tokenizer_change(info.extra.get("tokenizer"), trained_on.get("tokenizer")))
    if data is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        raise _agreed(f"error: the data changed since {info.path} was saved: {data}; these workers were "
                      f"restarted (--max-restarts) to resume that run: restore the data, or run the command again "
                      f"to resume on this data")
    if dist.get_rank() == 0:
        recorded = info.extra.get("settings")
        if isinstance(recorded, dict):
            settings = changed_settings(recorded, config)
            if "seq_len" in settings and recorded_seq_len(info.extra) == seq_len:
                del settings["seq_len"]  # given now as the length it trained at, or left to it
            changed = [f"{_switch(name, before)} -> {_switch(name, now)}"
                       if isinstance(before, bool) and isinstance(now, bool)
                       else f"{flag(name)} {_as_given(before)} -> {_as_given(now)}"
                       for name, (before, now) in settings.items()]
            # the data's change in length, whether or not --data is named changed above (a path
            # spelled otherwise may name the same data, and the same path other data)
            changed += (_changed_scale(info, trained_on["global_batch"], config.grad_accum)
                        + ([data] if data is not None else []))
            if _own_steps_dropped(info, recorded):  # none syncing now (said with --diloco), or other groups
                dropped = ("every group goes on from the model the groups agreed on at their last sync: the inner "
                           "steps since, each group's own, are not kept")
                if "diloco" in settings:
                    changed[list(settings).index("diloco")] += f" ({dropped})"
                else:
                    changed.append(f"and {dropped}" if changed else dropped)
            what = f"; this run changes {', '.join(changed)}" if changed else "; with its settings"
        else:
            what = " (it records no settings to compare this run's with)"
        print(one_line(f"resuming from {info.path} (step {info.step}, saved by {info.world_size} "
                       f"rank{'s' if info.world_size > 1 else ''}){what}"),
              flush=True)
    return info.step


def _own_steps_dropped(info: CheckpointInfo, recorded: dict) -> bool:
    """Whether this resume drops inner steps each group took since the groups' last sync: where the
    groups do not go on from their own progress (``CheckpointInfo.own_progress_dropped``) and the
    checkpoint was saved between syncs (``DiLoCo.agreed_after``)."""
    if not info.own_progress_dropped:
        return False
    saved = recorded_diloco(info.extra)  # None where it does not read: said as dropped
    return saved is None or not isinstance(info.step, int) or not saved.agreed_after(info.step, recorded.get("steps"))


def _switch(name: str, on: bool) -> str:
    """A switch's option as the user gives it: --reshard, or --no-reshard."""
    return flag(name) if on else f"--no-{flag(name)[2:]}"


def _as_given(value) -> str:
    """A setting's value as the resume line names it, cut short (a checkpoint's, as it recorded it):
    one the run was not given is "(not given)"."""
    return "(not given)" if value is None else cut(str(value))


def trained_otherwise(config: TrainConfig, seq_len: int) -> str | None:
    """Why no checkpoint of --checkpoint-dir fits this run's model, said before any is loaded (each
    would be skipped as another model's, for one reason said once per checkpoint): the newest was
    trained as another GPT preset, or as a model of the other kind (a preset, an ``hf:`` model), or as
    this model with what lays its weights out otherwise: other ``--units`` (a checkpoint holds a flat
    buffer per unit), or, for a GPT preset, another ``--seq-len`` (its position table has a row per
    token; an ``hf:`` model's weights do not depend on it), or an ``hf:`` model whose config changed
    since (``_architecture_change``). An ``hf:`` model recorded at another path may be the same model
    moved: loading tells. ``shardwire train`` asks it before any worker starts, so that the refusal is
    its one line alone; each worker again, as it resumes (under a torchrun of the user's)."""
    for path in reversed(list_checkpoints(config.checkpoint_dir)):
        try:
            extra = Manifest.read(path).extra
        except shardwire.CheckpointError:
            continue
        extra = extra if isinstance(extra, dict) else {}
        settings = extra.get("settings") if isinstance(extra.get("settings"), dict) else {}
        trained = extra.get("model")
        if trained != recorded_name(config.model):
            kind = _model_kind(trained) if isinstance(trained, str) else None
            if kind is not None and (kind != _model_kind(config.model) or kind == "preset"):
                return (f"{path} was trained as --model {trained}, and this run's is {config.model}: give --model "
                        f"{trained} to resume it, or another --checkpoint-dir to start a run of {config.model}")
            return None
        if "units" in settings and settings["units"] != config.units:
            trained, given = (f"--units {units}" if units else "the model's own units"
                              for units in (settings["units"], config.units))
            remedy = f"--units {settings['units']}" if settings["units"] else "no --units"
            return (f"{path} was trained with {trained}, and this run has {given}: a checkpoint holds its weights "
                    f"unit by unit, so give {remedy} to resume it")
        if (change := _architecture_change(config.model, path, extra.get("hf_config"),
                                           config_fields(config.model))) is not None:
            return change
        recorded = recorded_seq_len(extra)
        if config.model.startswith(HF_PREFIX) or recorded is None or recorded == seq_len:
            return None
        return (f"{path} was trained at --seq-len {recorded}, and this run's is {seq_len}: give --seq-len "
                f"{recorded} to resume it")
    return None


def _model_kind(model: str) -> str | None:
    """Which kind of model ``model`` names, as ``--model`` takes it: a GPT preset, an ``hf:`` model, or
    None for a name that is neither (a forged manifest's). Two kinds never share a checkpoint's layout."""
    return "preset" if model in PRESETS else "hf" if model.startswith(HF_PREFIX) else None


def _changed_scale(info, global_batch: int, grad_accum: int) -> list[str]:
    """The world size and global batch (the sequences of an optimizer step: ``global_batch``, each
    micro-batch's, times ``grad_accum``) this run changes from those the checkpoint ``info`` was
    saved with, in words."""
    world, changed = dist.get_world_size(), []
    if info.world_size != world:
        changed.append(f"world size {info.world_size} -> {world}")
    recorded, settings = info.extra.get("global_batch"), info.extra.get("settings")
    accumulated = settings.get("grad_accum", 1) if isinstance(settings, dict) else 1
    if (isinstance(recorded, int) and isinstance(accumulated, int)
            and recorded * accumulated != global_batch * grad_accum):
        changed.append(f"global batch {recorded * accumulated} -> {global_batch * grad_accum} sequences (--batch is "
                       f"per rank)")
    return changed


def _check_architecture(config: TrainConfig, info, now: dict | None) -> None:
    """Refuse to resume an ``hf:`` model whose config differs from the one the checkpoint ``info``
    recorded (``_architecture_change``)."""
    if (change := _architecture_change(config.model, info.path, info.extra.get("hf_config"), now)) is not None:
        raise _agreed(f"error: {change}")


def _architecture_change(model: str, path, recorded: object, now: dict | None) -> str | None:
    """Why the checkpoint at ``path``, whose ``hf:`` model's config was ``recorded``, cannot be
    resumed into ``model``, whose config is ``now``: the differences. The weights were trained
    for the recorded architecture (another activation or epsilon fits the same shapes, and would pair
    them with another model silently)."""
    if not isinstance(recorded, dict) or now is None or (change := config_difference(recorded, now)) is None:
        return None
    return (f"{model}'s config differs from the one {path} was trained with: {change}; its weights belong to the "
            f"recorded architecture: restore the config, or give --checkpoint-dir a new directory")


def _set_hyperparameters(config: TrainConfig, optimizer, scheduler, step: int) -> None:
    """This run's learning rate and weight decay over what the checkpoint's optimizer and schedule held:
    a run that resumes with another --lr trains at it, from the schedule's point at ``step``."""
    scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
    for group, weight_decay in zip(optimizer.param_groups, (config.weight_decay, 0.0)):  # as _param_groups makes them
        group["initial_lr"] = config.lr
        group["lr"] = config.lr * _lr_factor(step, config)
        group["weight_decay"] = weight_decay


def _save_checkpoint(config: TrainConfig, model, optimizer, scheduler, step: int,
                     trained_on: dict) -> pathlib.Path:
    """Save ``step`` into the series in --checkpoint-dir; the data position is the step itself, and
    ``trained_on`` (``_trained_on``) what it trained beside the settings. The series is pruned to
    --keep by ``_Divergence``, which knows which checkpoints a loss has vouched for. A save that
    fails (a full disk) stops the run in one line: the checkpoints before it are intact."""
    path = shardwire.checkpoint_path(config.checkpoint_dir, step)
    try:
        shardwire.save_checkpoint(
            path, model, optimizer,
            step=step, extra={"scheduler": scheduler.state_dict(), "model": recorded_name(config.model),
                              "settings": training_settings(config), **trained_on},
        )
    except DirectoryMoved as err:  # its checkpoints are no longer where a run again would look
        raise _agreed(f"error: {err}") from None
    except shardwire.CheckpointError as err:
        raise _agreed(f"error: {err} (the checkpoints saved before it are intact: make room there, or give another "
                      f"--checkpoint-dir, and run the command again to resume from the newest)") from None
    return path


def _profiler(config: TrainConfig, choice: ModelChoice, model, optimizer, tokens_per_step: int) -> Profiler:
    flops = (flops_per_token(choice.spec, activation_checkpointing=config.activation_checkpointing)
             if choice.spec is not None and choice.counts_flops else None)  # MFU needs a count of the model's
    counted = None
    if choice.runs_on_meta:
        with torch.device("meta"):  # torch's own count of the same model, as a cross-check
            meta_model = choice.build()
            tokens = torch.zeros(1, choice.seq_len + 1, dtype=torch.long)
        counted = torch_counted_flops_per_token(
            lambda: loss_fn(choice.logits(meta_model, tokens[:, :-1]), tokens[:, 1:]).backward(), choice.seq_len)
    model_name = recorded_name(config.model)  # an hf: path made absolute: one model however it was spelled
    metadata = {
        "model": model_name,
        "precision": config.precision,
        # the job as it ran: its sequence length the model's own where --seq-len was not given
        "config": {**dataclasses.asdict(config), "model": model_name, "seq_len": choice.seq_len},
        # the model as the simulator describes it, as it was when the run read it: an hf: directory
        # edited since names another model (its FLOPs per token may not tell: a tied head)
        "model_spec": None if choice.spec is None else as_dict(choice.spec),
        "torch_counted_flops_per_token": counted,
        # the ranks each optimizer state is split over, whose share of it the optimizer step streams
        "optimizer_ranks": engine_of(model).layout.plan.split_over,
    }
    return Profiler(model, optimizer, tokens_per_step=tokens_per_step, flops=flops,
                    peak_tflops=config.peak_tflops, metadata=metadata)


def _new_run_dir() -> str:
    """The default --run-dir, ``runs/<date-time>`` as the run ends, made here so that it is this run's
    alone: two runs that end in the same second (started together) would write one profile over the
    other's, so the second gets ``-2``. Where it cannot be made, its name: the profile's write then
    fails as any would, on every rank."""
    stem = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    try:
        os.makedirs("runs", exist_ok=True)
        for n in itertools.count(1):
            candidate = stem if n == 1 else f"{stem}-{n}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(candidate)
                return candidate
    except OSError:
        return stem


def _save_profile(profiler: Profiler, config: TrainConfig, rank: int) -> None:
    claimed = config.run_dir is None and rank == 0  # only rank 0 writes (Profiler.save)
    run_dir = config.run_dir or (_new_run_dir() if claimed else "")
    try:
        summary = profiler.save(run_dir)
    except OutputRefused as err:  # a full disk, met by every rank (Profiler.save): the checkpoints stand
        if claimed:
            with contextlib.suppress(OSError):
                os.rmdir(run_dir)  # made for the profile, and empty: a failed run leaves nothing it made
        raise _agreed(f"error: --run-dir: {err}") from None
    if rank != 0:
        return
    # plots a report drew there before would be taken for this run's: said, and left as they are
    if drawn := results_in(run_dir, "report-plot"):
        shown_plots = ", ".join(drawn[:4]) + (f" and {len(drawn) - 4} more" if len(drawn) > 4 else "")
        print(f"note: {shown_plots} in {run_dir} were drawn by `shardwire report` before this profile was written: "
              f"run it again to draw this one", file=sys.stderr, flush=True)
    f = summary["typical_step"]["figures"]  # one rank's own parts, which add up to its step
    mfu = f"MFU {summary['mfu']:.1%}" if "mfu" in summary else "MFU unknown (no peak)"
    if summary.get("mfu", 0) > 1:
        mfu += " (above 100%: the probed peak is too low for this device and dtype; pass --peak-tflops)"
    print(
        f"profile: step {f['step_s'] * 1e3:.0f} ms on the slowest rank: forward {f['forward_s'] * 1e3:.0f}, "
        f"backward {f['backward_s'] * 1e3:.0f} ({f['copy_s'] * 1e3:.0f} of those copying), "
        f"clip {f['clip_s'] * 1e3:.0f}, optimizer {f['optimizer_s'] * 1e3:.0f}, other {f['other_s'] * 1e3:.0f}, "
        f"waiting for communication {f['wait_s'] * 1e3:.0f} ms; communication {f['comm_s'] * 1e3:.0f} ms, "
        f"{f['overlap_ratio']:.0%} hidden; at the median step ({summary['step_time_s'] * 1e3:.0f} ms) "
        f"{summary['model_tflops_per_worker']:.3f} TFLOP/s per worker, {mfu}\n"
        + one_line(f"profile written to {run_dir} (shardwire report {shlex.quote(str(run_dir))} plots it)"),
        flush=True,
    )
