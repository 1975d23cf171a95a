"""What several test modules share: processes that start fast, a function run on several gloo ranks
in such processes (each rank's result or error collected), torch's matrix-multiply precision set for
a block, the most memory a block's tensors held, a small Hugging Face tokenizer, and a checkpoint's
manifest edited as a forger would."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import pathlib
import pickle
import queue
import statistics
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from shardwire.models.gpt import GPT


# A profile of ``shardwire train --profile`` (GPT 1.3B on an H200), for the readers of profiles.
PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "gpu",
                       "h200-profiles", "gpt-1.3b-b8.json")


def summarised(profile: dict) -> dict:
    """``profile`` (a document of ``shardwire train --profile``) with its summary made again from its
    steps as the profiler makes it: a profile whose steps a test changed, still one a run writes."""
    steps = profile["steps"][profile["warmup_steps"]:] or profile["steps"]
    figures = profile["summary"]["figures"]
    for name, stats in figures.items():
        figures[name] = {stat: statistics.median(step["figures"][name][stat] for step in steps) for stat in stats}
    profile["summary"]["tokens_per_s"] = profile["tokens_per_step"] / figures["step_s"]["max"]
    return profile


def measured(profile: dict, name: str, seconds: float) -> dict:
    """``profile`` as if every step had taken ``seconds`` in its part ``name`` (``forward_s``) on
    every rank, each rank's step as long as its parts then add up to, its steps' figures and its
    summary saying so."""
    from shardwire.profile.document import PARTS

    for step in profile["steps"]:
        for figures in step["ranks"]:
            figures[name] = seconds
            figures["step_s"] = math.fsum(figures[key] for key, _ in PARTS)
    return timelined(profile)


def timelined(profile: dict) -> dict:
    """``profile`` with the timeline a run would write of its steps as a test changed them: each
    rank's spans of its first step after warmup laid end to end from its figures (forward,
    backward, clip and optimizer, the rest of its compute, its wait; each collective from the
    step's start, for as long as it took), and that step's figures made again from them as the
    profiler makes them; then its figures and summary (``figured``)."""
    from shardwire.profile import analysis

    steps = profile["steps"]
    step = steps[min(profile["warmup_steps"], len(steps) - 1)]
    ranks = []
    for figures in step["ranks"]:
        at, phases = 0.0, []
        for phase in analysis.PHASES:
            phases.append([phase, None, at, at + figures[f"{phase}_s"]])
            at += figures[f"{phase}_s"]
        at += figures["other_s"]
        end = at + figures["wait_s"]
        comms = [[op, "unit", figures[f"{op}_bytes"], figures[f"{op}_bytes"], 0.0, min(figures[f"{op}_s"], end)]
                 for op in analysis.OPS if figures[f"{op}_s"] > 0]
        spans = analysis.StepTimeline(step["step"], 0.0, end, phases, comms, [["unit", at, end]])
        figures.update(analysis.breakdown(spans))
        ranks.append(dataclasses.asdict(spans))
    profile["timeline"] = {"step": step["step"], "ranks": ranks}
    return figured(profile)


def figured(profile: dict) -> dict:
    """``profile`` with each step's figures made again from its ranks' (the least, median and most),
    and its summary from its steps, as the profiler makes them: a profile whose ranks a test changed,
    still one a run writes."""
    for step in profile["steps"]:
        for figure in step["figures"]:
            values = [figures[figure] for figures in step["ranks"]]
            step["figures"][figure] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return summarised(profile)


def processes():
    """A multiprocessing context whose processes start in a tenth of a second: each is forked from a
    server that imported torch, dynamo and shardwire's engine once, where spawn's import them again
    in every process (seconds each on two cores, most of a short multi-process test). Start them
    with ``process``."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "shardwire.engine.shard",
                                    "harness"])
    return context


def process(context, target, *args, results, env: dict | None = None):
    """A process of ``context`` (``processes()``) that runs ``target(*args, results)`` in the
    caller's environment as it is now, with ``env`` over it (``_in_environment``); ``results``, a
    queue of the context, passes as only inheritance passes it."""
    call = pickle.dumps((target, args))
    return context.Process(target=_in_environment, args=({**os.environ, **(env or {})}, call, results))


def _in_environment(environ: dict, call: bytes, results):
    """The call ``process`` packed, with ``environ`` as the process's environment, set before the call
    is unpacked (which imports the test module that defines its target). A forked process would
    otherwise hold the environment its server started with; and torch, loaded there, read
    OMP_NUM_THREADS there, so its thread count is set again from it. What other modules read as they
    load (torch's logging variables, dynamo's configuration) keeps the server's values: a test that
    sets those needs a process started afresh (``subprocess``)."""
    os.environ.clear()
    os.environ.update(environ)
    if (threads := environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    target, args = pickle.loads(call)
    return target(*args, results)


def _worker(rank, world, store_path, fn, args, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        # Plain pickle: torch's queue would pass tensors as shared memory that dies with this process.
        results.put(pickle.dumps((rank, True, fn(rank, world, *args))))
    except BaseException as err:  # report everything, including assertion failures
        results.put(pickle.dumps((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # skip process-group teardown, which can block when a peer failed


def run_workers(world: int, fn, *args, timeout: float = 240.0, env: dict | None = None,
                expect_errors: bool = False) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results in rank order.

    With ``expect_errors`` a rank's exception is returned as its result (its message as a string)
    instead of failing the caller. A run that outlives ``timeout``, or a rank that ends without a
    result (killed, or unable to start), is killed and fails.
    """
    ctx = processes()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [process(ctx, _worker, rank, world, os.path.join(tmp, "store"), fn, args, results=results, env=env)
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        outcome: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world:
                # a rank that ended had put its result before it did: one more wait finds it
                ended = [r for r, proc in enumerate(procs) if proc.exitcode is not None and r not in outcome]
                try:
                    rank, ok, value = pickle.loads(results.get(timeout=1.0))
                    outcome[rank] = (ok, value)
                    continue
                except queue.Empty:
                    pass
                if lost := [r for r in ended if r not in outcome]:
                    codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in lost)
                    raise AssertionError(f"ranks ended without a result (exit codes {codes})")
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world)) - set(outcome))} did not finish "
                                         f"within {timeout}s")
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    if failures and not expect_errors:
        first = min(failures)
        raise AssertionError(f"rank {first} failed:\n{failures[first]}")
    return [outcome[r][1] for r in range(world)]


@contextlib.contextmanager
def matmul_precision(matmul: str, everything: str = "none"):
    """torch's fp32 precision of CUDA matrix multiplies (and its global default) set for the block,
    then restored: set as users set it, through attributes pytest's monkeypatch cannot restore."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.fp32_precision
    torch.backends.fp32_precision = everything
    torch.backends.cuda.matmul.fp32_precision = matmul
    try:
        yield
    finally:
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


def peak_allocated(fn) -> int:
    """The most bytes ``fn()``'s tensors held at once, beyond what was held as it began, on this
    thread, as the profiler records torch's allocations: what is allocated counts whether or not its
    pages were written (unlike a resident set, which misses an ``empty`` buffer never filled)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        fn()
    events = sorted((e for e in profiled.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def save_tokenizer(directory) -> None:
    """A byte-level BPE tokenizer asked for 300 ids, of which one sentence gives about 60 ("<eos>"
    among them), saved into ``directory`` as ``save_pretrained`` writes it (needs the hf extra)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                                  trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(directory)


def byte_tokenizer(directory: pathlib.Path, shift: int) -> pathlib.Path:
    """A tokenizer of one id per character, ``shift`` apart from another's: the same text, other ids
    (needs the hf extra)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(c): (c + shift) % 256 for c in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chr(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=chr(0)).save_pretrained(directory)
    return directory


def rewrite_manifest(checkpoint: pathlib.Path, change, *, reseal: bool = True) -> None:
    """Edit a checkpoint's manifest; ``reseal`` records the sha256 of the edited contents (the
    canonical serialization: sorted keys, no whitespace), as a tool that forges one would."""
    path = checkpoint / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if reseal and "sha256" in manifest:
        body = {key: value for key, value in manifest.items() if key != "sha256"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        manifest["sha256"] = hashlib.sha256(canonical.encode()).hexdigest()
    path.write_text(json.dumps(manifest, indent=1))


class FillingFile(io.FileIO):
    """A file on a disk that fills part-way through the write."""

    def write(self, data) -> int:
        super().write(bytes(data[:10]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch):
    """The temporary files of ``write_atomically`` meet a full disk as they are written (ENOSPC); every
    other file is written as ever."""
    fdopen = os.fdopen

    def filling(fd, *args, **kwargs):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            return FillingFile(fd, "wb")
        return fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", filling)


class CheckpointedGPT(GPT):
    """The GPT with torch's checkpoint (``torch.utils.checkpoint``, with ``checkpoint``'s options)
    around its blocks as ``regions`` groups them: blocks -> the callables checkpointed in turn, one
    per block being nanoGPT's pattern."""

    def __init__(self, config, regions, **checkpoint):
        super().__init__(config)
        self.regions, self.checkpoint = regions, checkpoint

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for region in self.regions(self.blocks):
            x = torch.utils.checkpoint.checkpoint(region, x, **self.checkpoint)
        return self.head(self.norm(x))
