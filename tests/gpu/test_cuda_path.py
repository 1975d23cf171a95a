"""The engine on CUDA with NCCL at world 1: every piece of the sharding machinery runs (flat buffers,
gathers into them, prefetch, reductions, casts, side streams), with nothing to wait for on the wire.
A group of one's collectives are local copies on the side streams; the race tests also send them
through NCCL, as a larger world's go.

What only a GPU can show: that the engine's streams are ordered by events and nothing else (no host
synchronization after the first step), that no buffer's memory is reused while another stream still
uses it (collectives made to start late give bit-identical results), that memory is flat from step
to step, and that the profiler's CUDA timings add up.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardwire
from harness import matmul_precision
from shardwire.comm.communicator import Communicator
from shardwire.engine.limits import REDUCTIONS_IN_FLIGHT
from shardwire.engine.shard import engine_of
from shardwire.models.gpt import GPT, PRESETS, Block, loss_fn

pytestmark = pytest.mark.gpu

# deterministic cuBLAS, so that two runs can differ only through a race (set before CUDA starts)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CONFIG = dataclasses.replace(PRESETS["medium"], layers=4)


@pytest.fixture(scope="module", autouse=True)
def device():
    """A one-rank NCCL world on GPU 0 for the module (any other world of this process is ended)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


def batches(device, steps, grad_accum, batch=4):
    gen = torch.Generator(device=device).manual_seed(0)
    return [[torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.seq_len + 1), generator=gen, device=device)
             for _ in range(grad_accum)] for _ in range(steps)]


def run_steps(model, optimizer, data, *, sharded, clip=True):
    for micro_batches in data:
        for i, tokens in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last or not sharded else shardwire.no_sync(model):
                (loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / len(micro_batches)).backward()
        if clip and sharded:
            shardwire.clip_grad_norm_(model, 1.0)
        elif clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def sharded(device, seed=0, nccl=False, **kwargs):
    """The GPT sharded; with ``nccl``, its collectives sent through NCCL, as a larger world's go."""
    torch.manual_seed(seed)
    model = shardwire.shard(GPT(CONFIG).to(device), units=[Block], **kwargs)
    if nccl:
        for comm in engine_of(model).layout.communicators:
            comm.alone = False
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def full_params(model) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in shardwire.full_state_dict(model).items()}


# --------------------------------------------------------------------------------- the command


@pytest.mark.parametrize("extra", [[], ["--profile"], ["--grad-accum", "2"]])
def test_train_runs_end_to_end_on_nccl(tmp_path, extra):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "shardwire", "train", "--backend", "nccl", "--nproc", "1", "--precision", "bf16",
         "--model", "medium", "--steps", "30", "--eval-batches", "2", "--run-dir", str(run_dir), *extra],
        capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if "--profile" in extra:
        profile = json.loads((run_dir / "profile.json").read_text())
        summary = profile["summary"]
        # by hand: 6N + 12LHS FLOPs per token (N counted here), H100 SXM's dense bf16 peak
        config = PRESETS["medium"]
        n = sum(p.numel() for p in GPT(config).parameters())
        per_token = 6 * n + 12 * config.layers * config.hidden * config.seq_len
        by_hand = per_token * profile["tokens_per_step"] / summary["step_time_s"] / 1e12 / 989.0
        assert 0 < summary["mfu"] < 1
        if "H100 80GB HBM3" in torch.cuda.get_device_name(0) or "H200" in torch.cuda.get_device_name(0):
            assert summary["mfu"] == pytest.approx(by_hand, rel=0.1)


# -------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_matches_the_unsharded_model(device, reshard, prefetch, checkpointing, grad_accum):
    data = batches(device, 4, grad_accum)
    torch.manual_seed(0)
    reference = GPT(CONFIG).to(device)
    model = shardwire.shard(copy.deepcopy(reference), units=[Block], reshard_after_forward=reshard,
                            prefetch=prefetch, activation_checkpointing=checkpointing)
    with sdpa_kernel(SDPBackend.MATH), matmul_precision("ieee"):  # exact fp32, no TF32
        run_steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3), data, sharded=False)
        run_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data, sharded=True)
    expected = {k: v.float().cpu() for k, v in reference.state_dict().items()}
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-6, msg=name)


# ------------------------------------------------------------------------------ races flushed


@contextlib.contextmanager
def collectives_start_late(cycles: int):
    """Queue ``torch.cuda._sleep`` on a side stream before every collective issued there, so
    collectives start late while the host (and so the compute stream) runs ahead."""
    side = Communicator._side

    @contextlib.contextmanager
    def late(self, which, uses, after=None):
        with side(self, which, uses, after):
            if self.device.type == "cuda":
                torch.cuda._sleep(cycles)
            yield

    Communicator._side = late
    try:
        yield
    finally:
        Communicator._side = side


def compute_runs_late(model, optimizer, cycles: int) -> None:
    """Queue ``torch.cuda._sleep`` on the compute stream before every block's forward and before
    every optimizer step, so collectives run ahead of the compute that feeds or frees their buffers."""
    sleep = lambda *_: torch.cuda._sleep(cycles)  # noqa: E731
    for block in model.blocks:
        block.register_forward_pre_hook(sleep)
    optimizer.register_step_pre_hook(sleep)


@pytest.mark.parametrize("nccl", [False, True], ids=["copies", "nccl"])
@pytest.mark.parametrize("late", ["collectives", "compute"])
def test_late_streams_change_no_bit(device, late, nccl):
    data = batches(device, 5, grad_accum=2)
    results = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for cycles in (0, 2_000_000):
            model, optimizer = sharded(device, mixed_precision="bf16", prefetch=2, nccl=nccl)
            delayed = collectives_start_late(cycles) if late == "collectives" else contextlib.nullcontext()
            if late == "compute" and cycles:
                compute_runs_late(model, optimizer, cycles)
            with sdpa_kernel(SDPBackend.MATH), delayed:
                run_steps(model, optimizer, data, sharded=True)
            results.append(full_params(model))
    finally:
        torch.use_deterministic_algorithms(False)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


@pytest.mark.parametrize("nccl", [False, True], ids=["copies", "nccl"])
def test_the_first_gather_of_a_step_sees_the_optimizer_update(device, nccl):
    model, optimizer = sharded(device, prefetch=2, nccl=nccl)
    data = batches(device, 3, grad_accum=1)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda block, args: seen.append(block.mlp.up.weight.detach().clone()))
    # the update runs late on the compute stream: a gather that did not wait for it reads old values
    optimizer.register_step_pre_hook(lambda *_: torch.cuda._sleep(20_000_000))
    run_steps(model, optimizer, data, sharded=True)
    with torch.no_grad():
        model(data[0][0][:, :-1])
    current = full_params(model)["blocks.0.mlp.up.weight"].to(device)
    assert torch.equal(seen[-1].float(), current)  # the last forward saw the last update
    assert not torch.equal(seen[0], seen[-1])


# ------------------------------------------------------------------------------- no host sync


def test_steps_after_the_first_never_synchronize_the_host(device):
    """At world 1: the order checks of several ranks (pinned copies read by event) need 2 GPUs."""
    model, optimizer = sharded(device, mixed_precision="bf16")
    data = batches(device, 4, grad_accum=2)
    run_steps(model, optimizer, data[:1], sharded=True)  # the first step records the order
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_steps(model, optimizer, data[1:], sharded=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -------------------------------------------------------------------------------------- memory


def test_memory_is_flat_from_step_to_step_and_bounded(device):
    model, optimizer = sharded(device, mixed_precision="bf16", prefetch=2)
    data = batches(device, 6, grad_accum=1)
    allocated, reserved = [], []
    for i in range(len(data)):
        if i == 2:
            torch.cuda.reset_peak_memory_stats(device)
        run_steps(model, optimizer, data[i:i + 1], sharded=True)
        torch.cuda.synchronize(device)
        gc.collect()  # earlier tests' models (reference cycles) must not be freed mid-measurement
        allocated.append(torch.cuda.memory_allocated(device))
        reserved.append(torch.cuda.memory_reserved(device))
    assert len(set(allocated[1:])) == 1, allocated
    assert len(set(reserved[2:])) == 1, reserved
    peak = torch.cuda.max_memory_allocated(device)

    engine = engine_of(model)
    state = allocated[-1]  # shards, their gradients' absence and the optimizer state between steps
    largest = max(flat.gathered_nbytes for flat in engine.flats)
    grad_bytes = max(flat.packing.padded_numel * 4 for flat in engine.flats)
    units = (engine.prefetch + 2) * largest + (REDUCTIONS_IN_FLIGHT + 1) * grad_bytes
    # activations: what the unsharded model in bf16 autocast holds at its peak, beyond its weights
    torch.manual_seed(0)
    reference = GPT(CONFIG).to(device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = data[0][0]
    with torch.autocast("cuda", torch.bfloat16):
        loss_fn(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    activations = torch.cuda.max_memory_allocated(device) - before
    assert peak <= state + units + activations, (peak, state, units, activations)


# ------------------------------------------------------------------------------------ profiler


class _SleepInBackward(torch.autograd.Function):
    """The identity; its backward queues ``torch.cuda._sleep(cycles)`` on the compute stream."""

    @staticmethod
    def forward(ctx, cycles, tensor):
        ctx.cycles = cycles
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return None, grad


def profiled(device, delay_cycles: int, block_backward_cycles: int):
    """Median reduce-scatter and wait seconds of profiled steps, and the number of units.

    Each step starts with a long sleep on the compute stream, so the host queues the whole step
    before the GPU reaches it and every event times GPU work alone (with the GPU waiting on the
    host, a collective's span would also hold the host's time to launch it). Each block's backward
    is lengthened by ``block_backward_cycles`` so that a reduction has compute to hide behind."""
    from shardwire.profile.analysis import breakdown
    from shardwire.profile.profiler import Profiler

    model, optimizer = sharded(device, mixed_precision="bf16")
    for block in model.blocks:
        block.register_forward_pre_hook(
            lambda block, args: (_SleepInBackward.apply(block_backward_cycles, args[0]), *args[1:]))
    data = batches(device, 8, grad_accum=1, batch=8)
    run_steps(model, optimizer, data[:1], sharded=True)
    original = Communicator._by_itself  # a group of one's collectives: local copies on the side streams

    def delayed(self, which, op, tag, nbytes, tensors, body, after=None):
        def slower():
            if op == "reduce_scatter":
                torch.cuda._sleep(delay_cycles)  # on the reduce stream, inside the collective's events
            return body()
        return original(self, which, op, tag, nbytes, tensors, slower, after)

    profiler = Profiler(model, optimizer, tokens_per_step=8 * CONFIG.seq_len, peak_tflops=989.0)
    Communicator._by_itself = delayed
    try:
        for micro_batches in data[1:]:
            with profiler.step():
                torch.cuda._sleep(200_000_000)  # the host runs ahead of the GPU
                run_steps(model, optimizer, [micro_batches], sharded=True)
    finally:
        Communicator._by_itself = original
    timelines = profiler._recorder.timelines()
    profiler.close()
    figures = [breakdown(t) for t in timelines[1:]]
    return (statistics.median(f["reduce_scatter_s"] for f in figures),
            statistics.median(f["wait_s"] for f in figures),
            len(engine_of(model).flats))


def sleep_seconds(device, cycles: int) -> float:
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm-up: the clock settles
    start.record(stream)
    torch.cuda._sleep(cycles)
    end.record(stream)
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def test_profiler_reports_a_known_reduce_scatter_delay(device):
    cycles = 1_000_000
    delay = sleep_seconds(device, cycles)
    plain_rs, plain_wait, count = profiled(device, 0, 3 * cycles)
    delayed_rs, delayed_wait, _ = profiled(device, cycles, 3 * cycles)
    seen = f"reduce-scatter {plain_rs * 1e3:.3f} -> {delayed_rs * 1e3:.3f} ms, wait {plain_wait * 1e3:.3f} -> " \
           f"{delayed_wait * 1e3:.3f} ms, {count} units, delay {delay * 1e3:.3f} ms"
    assert delayed_rs - plain_rs == pytest.approx(delay * count, rel=0.2), seen
    # the last reductions land after the last backward, with nothing left to hide them: 2 delays
    assert delayed_wait <= plain_wait + 2 * delay, "a hidden delay must not show as waiting: " + seen


@pytest.mark.parametrize("bits", [8, 4])
def test_the_wire_codec_on_cuda_matches_the_cpu(device, bits):
    """The quantization kernels run on the GPU the values are on, bit for bit as on the CPU (the
    engine's NCCL path encodes and decodes on its side streams)."""
    from shardwire.comm.quantize import decode, encode
    from shardwire.comm.wire import Codec

    codec = Codec(bits, 256)
    rows = torch.randn(3, 10_001, generator=torch.Generator().manual_seed(bits))
    residual_cpu, residual_gpu = torch.zeros_like(rows), torch.zeros_like(rows, device=device)
    packed_cpu, packed_gpu = encode(codec, rows, residual_cpu), encode(codec, rows.to(device), residual_gpu)
    assert torch.equal(packed_gpu.cpu(), packed_cpu)
    assert torch.equal(residual_gpu.cpu(), residual_cpu)
    assert torch.equal(decode(codec, packed_gpu, 10_001).cpu(), decode(codec, packed_cpu, 10_001))
