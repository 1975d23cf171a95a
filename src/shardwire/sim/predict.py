"""Predictions: one configuration's step, and sweeps of one setting with their scaling efficiency.

``predict`` runs the step model and the memory model and condenses them into the figures users
compare with measurements: step time, compute time, time each kind of collective kept its lane
busy, how much longer compute took for the collectives running beside it (``compute_slowed``),
the communication computation had to wait for (``exposed``), throughput and MFU. The step is the
three together: compute at its full rate, plus its slowdown, plus the exposed waits.

FLOPs: ``tflops_per_gpu`` and ``mfu`` count model FLOPs (forward and backward, 3 x forward: what
the model needs, PaLM's definition of MFU); ``hardware_tflops_per_gpu`` adds the blocks'
recomputation under activation checkpointing (4 x their forward, less under a selective policy),
which is what the T5 document reports as TFLOP/s.

Scaling efficiency (the T5 document's definition): seconds per step normalized by the batch at N
nodes against 1 node, the batch being per GPU; that is, samples per GPU-second at N nodes over
samples per GPU-second at 1 node (1.0: every added GPU works as well as the first node's).
"""

from __future__ import annotations

import collections
import dataclasses

from shardwire.mappings import shown
from shardwire.sim.architecture import Architecture, architecture
from shardwire.sim.memory import MemoryEstimate, estimate_memory
from shardwire.sim.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec, as_dict, parse
from shardwire.sim.step import Timeline, simulate_step


@dataclasses.dataclass
class Prediction:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    arch: Architecture
    timeline: Timeline
    memory: MemoryEstimate

    @property
    def step_time_s(self) -> float:
        return self.timeline.step_time_s

    @property
    def compute_time_s(self) -> float:
        return self.timeline.compute_time_s

    @property
    def compute_slowed_s(self) -> float:
        return self.timeline.compute_slowed_s

    @property
    def compute_slowdown(self) -> float:
        """How much longer compute took beside running collectives, over its time alone."""
        return self.compute_slowed_s / self.compute_time_s if self.compute_time_s else 0.0

    @property
    def exposed_comm_s(self) -> float:
        return sum(stall.seconds for stall in self.timeline.stalls)

    @property
    def comm_s(self) -> dict[str, float]:
        """Seconds each kind of collective kept its lane busy, summed over the step."""
        busy = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
        for record in self.timeline.comms:
            busy[record.op] += record.busy_s
        return busy

    @property
    def samples_per_step(self) -> int:
        return self.training.micro_batch * self.training.grad_accum * self.cluster.world

    @property
    def samples_per_gpu_second(self) -> float:
        return self.training.micro_batch * self.training.grad_accum / self.step_time_s

    @property
    def model_flops_per_gpu(self) -> float:
        return self.arch.model_flops * self.training.micro_batch * self.training.grad_accum

    @property
    def hardware_flops_per_gpu(self) -> float:
        return self.arch.hardware_flops(self.training.recomputed) * self.training.micro_batch * self.training.grad_accum

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops_per_gpu / self.step_time_s / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops_per_gpu / self.step_time_s / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.cluster.peak_tflops

    @property
    def exposed_by_reason(self) -> dict[str, float]:
        totals: dict[str, float] = collections.defaultdict(float)
        for stall in self.timeline.stalls:
            totals[stall.reason] += stall.seconds
        return dict(sorted(totals.items(), key=lambda item: -item[1]))


def predict(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> Prediction:
    arch = architecture(model, training.compute_bytes)
    return Prediction(model, cluster, training, arch,
                      simulate_step(arch, cluster, training), estimate_memory(arch, cluster, training))


@dataclasses.dataclass
class Sweep:
    key: str
    values: list
    points: list[Prediction]
    reference: Prediction | None  # the 1-node configuration scaling efficiency is measured against

    @property
    def scaling_efficiency(self) -> list[float] | None:
        if self.reference is None:
            return None
        base = self.reference.samples_per_gpu_second
        return [p.samples_per_gpu_second / base for p in self.points]


# Each value of a sweep is a full prediction: more than this makes a table or plot nobody reads,
# and work that grows with the length of a command line.
MAX_SWEEP_VALUES = 64

SWEEPABLE = {
    "cluster": ("nodes", "gpus_per_node", "peak_tflops", "gpu_memory_gb", "matmul_efficiency", "attention_efficiency",
                "memory_efficiency"),
    "training": ("micro_batch", "grad_accum", "reduce_each_micro_batch", "prefetch", "layout", "shard_group_size",
                 "limiter", "gathers_per_unit", "precision", "reduce_precision", "fp8_all_gather", "compile",
                 "activation_checkpointing"),
}


def _swept(cluster: ClusterSpec, training: TrainingSpec, key: str, value) -> tuple[ClusterSpec, TrainingSpec]:
    """The cluster and training of a sweep's point, ``key`` set to ``value``; a value that cannot be
    simulated is refused naming it."""
    try:
        if key in SWEEPABLE["cluster"]:
            return parse("cluster", {**as_dict(cluster), key: value}), training
        return cluster, parse("training", {**as_dict(training), key: value})
    except SpecError as err:
        raise SpecError(f"at {key} {shown(value)}: {err}") from None


def sweep(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, key: str, values: list) -> Sweep:
    """Predict each value of ``key`` (a cluster or training setting); for a sweep over ``nodes``,
    with scaling efficiency against 1 node (simulated even when not among ``values``, and left out
    where 1 node cannot run the settings, as hybrid groups wider than a node)."""
    if len(values) > MAX_SWEEP_VALUES:
        raise SpecError(f"a sweep of {len(values)} values is more than the {MAX_SWEEP_VALUES} it takes: "
                        f"sweep fewer values, or several sweeps")
    if key not in SWEEPABLE["cluster"] + SWEEPABLE["training"]:
        known = ", ".join(SWEEPABLE["cluster"] + SWEEPABLE["training"])
        raise SpecError(f"cannot sweep {shown(key)}; settings that can be swept: {known}")
    configs = [_swept(cluster, training, key, v) for v in values]
    values = [getattr(c if key in SWEEPABLE["cluster"] else t, key) for c, t in configs]  # as read: 1e3 is 1000
    if len(set(values)) < len(values):  # two rows of one configuration, one of them not meant
        raise SpecError(f"the sweep of {key} gives {shown(next(v for v in values if values.count(v) > 1))} twice: "
                        f"give each value once")
    points = []
    for (c, t), value in zip(configs, values):
        try:
            points.append(predict(model, c, t))
        except SpecError as err:  # the point that cannot be simulated, named
            raise SpecError(f"at {key} {shown(value)}: {err}") from None
    reference = None
    if key == "nodes":
        reference = next((p for p in points if p.cluster.nodes == 1), None)
        if reference is None:
            try:
                reference = predict(model, parse("cluster", {**as_dict(cluster), "nodes": 1}), training)
            except SpecError:  # a setting of the points swept that one node cannot hold: no efficiency
                reference = None
    return Sweep(key, values, points, reference)
