"""``shardwire train --plan auto``: a run that measures its cluster and picks its own layout.

Before training, every worker takes part in two short measurements, and the simulator decides:

1. **the network**: the engine's own all-gathers and reduce-scatters (``shardwire bench``'s engine
   with ``--impl shardwire``) over each node's ranks and over one rank per node, at
   ``PROBE_SIZES``: each level's busbw and latency per step, and what a running all-gather and
   compute take from each other (``--contention``), as ``shardwire simulate --cluster-from`` reads
   a bench file;
2. **the compute**: ``PROBE_STEPS`` steps of the job as given, under the profiler, then thrown
   away: the medians of the steps after the first fit the compute model, as ``shardwire simulate
   --calibrate`` fits a profile, less what the probe's own collectives took from them (the
   simulator's slowdown of the probed configuration). A known GPU (an A100, H100 or H200) keeps its preset's memory and
   bandwidth; any other device, a CPU among them, is given a nominal peak of ``NOMINAL_PEAK`` times
   the rate the probe reached (only the fitted fraction of it enters a prediction);
3. **the choice**: ``shardwire plan``'s search (``shardwire.sim.planner.plan``) over the layouts,
   shard groups, prefetch depths and resharding at the job's global batch, holding its
   micro-batch, accumulation and checkpointing as given. ``auto`` searches exact collectives
   only; ``auto-lossy`` also weighs quantized wires and syncing every H steps (DiLoCo), which
   change the optimisation.

Every rank gets the same measurements (the bench's results are every rank's, rank 0's profile is
broadcast) and so makes the same choice. The run then starts from its seed with the chosen settings,
as if they had been given: the probe leaves nothing behind. ``StepCheck`` sets the steps the run
measures against the prediction and says so where they differ by more than ``AGREEMENT``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwire import worker
from shardwire.bench import report
from shardwire.bench.benchmark import BenchConfig, benchmark
from shardwire.comm.quantize import encode_rate
from shardwire.mappings import Missing
from shardwire.options import command_line
from shardwire.placement import Placement
from shardwire.sim.architecture import architecture
from shardwire.sim.calibrate import Measured, calibrated
from shardwire.sim.inputs import cluster_from_bench_document, load_model
from shardwire.sim.memory import GIB
from shardwire.sim.planner import TIE, plan, runnable
from shardwire.sim.presets import GPUS
from shardwire.sim.predict import predict
from shardwire.sim.specs import ClusterSpec, LinkSpec, SpecError, TrainingSpec, as_dict, parse
from shardwire.sim.step import layout_plan
from shardwire.training.config import TrainConfig

# The collectives measured, smallest to largest, four times apart: enough for a latency and a
# bandwidth on each level, a few seconds at 100 Mbit/s.
PROBE_SIZES = (256 << 10, 4 << 20)
# Measurements of the collectives before a level without a rate is refused (a busy machine's noise).
PROBE_TRIES = 3
# Steps trained and thrown away to measure the compute; the first is left out (it records the
# units' order and warms the allocator).
PROBE_STEPS = 3
NOMINAL_PEAK = 2.0
# The probe's compute is taken to have run at no less than this part of its rate alone, whatever its
# collectives are priced to have taken from it.
MOST_SLOWED = 0.25
# The run's steps measured against the prediction: after the first WARMUP_STEPS, CHECKED_STEPS of them.
WARMUP_STEPS, CHECKED_STEPS = 2, 5
AGREEMENT = 0.15
# Known GPUs by the name CUDA reports: their presets' memory, bandwidth and kernels' rates.
_KNOWN_GPUS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-{memory}gb"))


class PlanError(Exception):
    """What stops a plan: every rank meets it alike (their measurements are the same)."""


@dataclasses.dataclass(frozen=True)
class Planned:
    """What ``--plan`` chose: the run's settings, the step the simulator predicts for them."""

    config: TrainConfig
    predicted_step_s: float


def unplannable(config: TrainConfig) -> str | None:
    """Why ``--plan`` cannot plan ``config``'s job, said before any worker starts and measures; None
    where it can. The simulator must describe the model, and price its precision on this machine: a
    measured CPU has no fp8 rate (the probe fits one peak), nor a GPU the simulator does not know."""
    leave_out = "leave out --plan to train with the settings as given"
    try:
        load_model(config.model, config.seq_len)
    except ValueError as err:  # SpecError among them
        return f"--plan {config.plan}: {err}; {leave_out}"
    if config.precision == "fp8" and not worker.uses_cuda(config.backend):
        return f"--plan {config.plan} prices fp8 only on a GPU the simulator knows, not on this CPU: {leave_out}"
    return None


def plan_run(config: TrainConfig, device: torch.device,
             probe: Callable[[TrainConfig, torch.device, int], dict[str, float]]) -> Planned | None:
    """Measure this cluster, predict each configuration and return the fastest (every rank must call
    it); None on one rank, where nothing is communicated. ``probe(config, device, steps)`` trains
    ``steps`` steps of ``config`` and returns every rank the medians of rank 0's ``forward_s``,
    ``backward_s`` and ``optimizer_s``. Rank 0 prints what was measured and chosen."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *_, **__: None)
    if world == 1:
        say(f"plan {config.plan}: one rank communicates nothing: the settings stay as given", flush=True)
        return None
    launched = Placement.launched(world)
    network = _measure_network(config, device, launched)
    compute = probe(config, device, PROBE_STEPS)
    fixed = {"micro_batch": config.batch, "grad_accum": config.grad_accum,
             "activation_checkpointing": config.activation_checkpointing}
    try:
        model = load_model(config.model, config.seq_len)
        base = parse("training", {**fixed, "precision": config.precision, "compile": config.compile})
        probed = parse("training", {**as_dict(base), "layout": config.layout, "prefetch": config.prefetch,
                                    "shard_group_size": config.shard_group_size,
                                    "reshard_after_forward": config.reshard})
        cluster = _cluster(network, compute, device, launched, model, base, probed,
                           lossy=config.plan == "auto-lossy")
        found = plan(model, cluster, config.batch * config.grad_accum * world, base, exact=config.plan == "auto",
                     fixed=fixed)
    except (SpecError, Missing) as err:  # Missing: the probe's own bench document, read as any bench's
        raise PlanError(f"--plan {config.plan}: {err}; leave out --plan to train with the settings as given") from None
    best, runner_up = found.best, found.runner_up
    if found.diloco is not None and found.diloco.step_time_s < best.step_time_s * (1 - TIE):
        best, runner_up = found.diloco, best
    planned = _apply(config, best.training, cluster)
    say(f"plan {config.plan}: measured {_levels(cluster, launched)}; {PROBE_STEPS - 1} of {PROBE_STEPS} probe steps "
        f"of {_settings(config)} computed: forward {compute['forward_s'] * 1e3:.0f}, backward "
        f"{compute['backward_s'] * 1e3:.0f}, optimizer {compute['optimizer_s'] * 1e3:.0f} ms", flush=True)
    other = "" if runner_up is None else (f"; runner-up {_settings(_apply(config, runner_up.training, cluster))} "
                                         f"({runner_up.step_time_s:.3g} s)")
    say(f"plan {config.plan}: chose {_settings(planned)}, predicted step {best.step_time_s:.3g} s{other}", flush=True)
    return Planned(planned, best.step_time_s)


class StepCheck:
    """Times the run's steps from ``WARMUP_STEPS`` after its start for ``CHECKED_STEPS`` and, on rank
    0, sets their mean against the predicted step. Each step is timed from its start to its end,
    which is what the simulator predicts: what the run does between steps (evaluating, logging,
    saving) is not a step's."""

    def __init__(self, planned: Planned, start: int, steps: int, device: torch.device):
        self._planned = planned
        self._first = start + WARMUP_STEPS
        self._last = self._first + CHECKED_STEPS if self._first + CHECKED_STEPS <= steps else None
        if self._last is None and dist.get_rank() == 0:
            print(f"plan: the prediction is not checked: the run ends at step {steps}, before the "
                  f"{CHECKED_STEPS} steps after step {self._first} it would time (give --steps "
                  f"{self._first + CHECKED_STEPS} or more)", flush=True)
        self._device = device
        self._started: float | None = None
        self._spent, self._timed = 0.0, 0

    def starting(self, step: int) -> None:
        """Call as each step starts."""
        if self._checks(step):
            self._started = self._now()

    def ended(self, step: int) -> None:
        """Call as each step ends (its optimizer step taken)."""
        if not self._checks(step) or self._started is None:
            return
        self._spent += self._now() - self._started
        self._timed += 1
        if step + 1 < self._last or dist.get_rank() != 0:
            return
        measured = self._spent / self._timed
        predicted = self._planned.predicted_step_s
        off = measured / predicted - 1
        verdict = (f"within {AGREEMENT:.0%}" if abs(off) <= AGREEMENT else
                   f"more than {AGREEMENT:.0%} off: the simulator's picture of this cluster is wrong here; the "
                   f"chosen settings may not be the fastest (docs/simulator.md, calibration)")
        print(f"plan: steps {self._first + 1}-{self._last} took {measured:.3g} s each against {predicted:.3g} s "
              f"predicted ({off:+.0%}), {verdict}", flush=True)

    def _checks(self, step: int) -> bool:
        return self._last is not None and self._first <= step < self._last

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()


def _measure_network(config: TrainConfig, device: torch.device, launched: Placement) -> dict:
    """The bench document of the engine's all-gathers and reduce-scatters on each level this
    launch has (each node's ranks, one rank per node). A probe so short that a busy machine's noise
    hides how time grows with size leaves a level without a rate: it is measured again, up to
    ``PROBE_TRIES`` times (every rank gets the same results, so every rank tries alike)."""
    groups = [name for name, size in (("intra", launched.ranks_per_node), ("inter", launched.nodes)) if size > 1]
    settings = BenchConfig(ops=["all_gather", "reduce_scatter"], groups=groups, impl="shardwire",
                           min_bytes=PROBE_SIZES[0], max_bytes=PROBE_SIZES[1], step_factor=4, warmup=1, iters=3,
                           backend=config.backend, timeout=config.timeout, contention=True)
    for _ in range(PROBE_TRIES):
        results = benchmark(settings, device)
        document = report.document(results.context, results.ops, results.contention)
        if all(any(fit.get("beta_Bps") for fit in document["fit"].get(group, {}).values()) for group in groups):
            break
    return document


def _cluster(network: dict, compute: dict[str, float], device: torch.device, launched: Placement,
             model, base: TrainingSpec, probed: TrainingSpec, *, lossy: bool) -> ClusterSpec:
    """This cluster as the simulator describes one: its device, its measured levels, its compute
    model fitted to the probe's steps (of ``probed``). The probe computed beside its own
    collectives, slower by what they took: the model is fitted to what its forward and backward
    would have taken alone, as the simulator prices that slowdown."""
    gpu = _known_gpu(device)
    quantize = encode_rate(device) / 1e9 if lossy and gpu is None else None
    computing = compute["forward_s"] + compute["backward_s"]
    flops = 3 * architecture(model, base.compute_bytes).forward_flops * base.micro_batch * base.grad_accum

    def fitted(alone: float) -> ClusterSpec:
        if gpu is None:
            machine = dict(gpu=f"this {device.type}", peak_tflops=NOMINAL_PEAK * flops / (alone * computing) / 1e12,
                           gpu_memory_gb=worker.memory_per_worker(worker.backend_for(device),
                                                                  launched.ranks_per_node) / GIB,
                           quantize_gelems=quantize)
        else:
            machine = GPUS[gpu]
        unmeasured = LinkSpec(busbw_GBps=1.0)  # replaced by the measured levels
        described = ClusterSpec(name="this cluster", nodes=launched.nodes, gpus_per_node=launched.ranks_per_node,
                                intra_node=unmeasured, inter_node=unmeasured, **machine)
        measured = cluster_from_bench_document(network, "the probe's collectives", described)
        steps = Measured(compute["forward_s"] * alone, compute["backward_s"] * alone, compute["optimizer_s"],
                         ranks=layout_plan(measured, probed).split_over, model=model, training=base)
        return calibrated(measured, steps, "the probe's steps")

    slowed = predict(model, fitted(1.0), probed).compute_slowed_s
    return fitted(max(1 - slowed / computing, MOST_SLOWED))


def _known_gpu(device: torch.device) -> str | None:
    """The GPU preset of ``device``, where it is one the simulator knows."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    memory = 80 if torch.cuda.get_device_properties(device).total_memory > 60 * GIB else 40
    return next((preset.format(memory=memory) for key, preset in _KNOWN_GPUS if key in name), None)


def _apply(config: TrainConfig, t: TrainingSpec, cluster: ClusterSpec) -> TrainConfig:
    """``config`` with the settings of the planned configuration ``t``."""
    _, shard = runnable(t, cluster)
    return dataclasses.replace(config, layout=shard["layout"], shard_group_size=shard.get("shard_group_size"),
                               reshard=shard["reshard_after_forward"], prefetch=shard["prefetch"], wire=shard["wire"],
                               diloco=shard.get("diloco", "none"))


def _settings(config: TrainConfig) -> str:
    """The settings a plan chooses, as the command line gives them (``command_line``), those unset out."""
    return " ".join(command_line({
        "layout": config.layout, "shard_group_size": config.shard_group_size, "prefetch": config.prefetch,
        "reshard": config.reshard, **{name: getattr(config, name) for name in ("wire", "diloco")
                                      if getattr(config, name) != "none"}}))


def _levels(cluster: ClusterSpec, launched: Placement) -> str:
    """The measured levels, as the plan's first line names them."""
    levels = [("each node's ranks", cluster.intra_node, launched.ranks_per_node),
              ("between nodes", cluster.inter_node, launched.nodes)]
    return " and ".join(f"{where} at {_rate(link.busbw_GBps)} ({link.latency_us:,.0f} us a step)"
                        for where, link, size in levels if size > 1)


def _rate(GBps: float) -> str:
    """Three figures, never an exponent: a loopback link can measure in the thousands of GB/s."""
    if GBps < 1:
        return f"{GBps * 1e3:.3g} MB/s"
    return f"{GBps:,.0f} GB/s" if GBps >= 100 else f"{GBps:.3g} GB/s"
