"""The compute model fitted to what one GPU did, so that only the network remains to predict.

A GPU preset's efficiencies are estimates for a whole generation; the GPU a user will rent runs its
own clocks, drivers and kernels. A profile of a few training steps on one GPU of that kind
(``shardwire train --profile``, or ``benchmarks/gpu_single.py --trace``) measures what its kernels
did: the step's forward, backward and optimizer times, for a model and batch the profile names.
From those the compute model is fitted:

* the optimizer step streams ``OPTIMIZER_BYTES_PER_PARAM`` per parameter of the rank's shard: its
  time gives the rate it does so (``optimizer_GBps``);
* forward and backward are FLOP-bound work (matrix multiplies and attention) plus memory-bound work
  at the GPU's memory bandwidth: the FLOP-bound part is what the measured compute leaves once the
  memory-bound part is taken out, and the matrix multiply and attention efficiencies are scaled by
  one factor so that the model's compute of the profiled job equals the measured one.

The shapes' effect on efficiency (the additive roofline of ``shardwire.sim.compute``) stays the
model's, so a profile of one model and batch predicts others on the same GPU; the closer the
profiled job is to the predicted one, the less rests on the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

from shardwire.engine.layout_plan import LayoutPlan
from shardwire.mappings import Missing, cut, field, is_number, one_line, shown
from shardwire.profile import PROFILE_FILE, analysis
from shardwire.profile.document import DamagedProfile, read_profile_document, tokens_problem
from shardwire.sim.architecture import Architecture, architecture
from shardwire.sim.compute import OPTIMIZER_BYTES_PER_PARAM, backward_s, forward_s
from shardwire.sim.specs import (
    MIN_BANDWIDTH_GBPS,
    MIN_EFFICIENCY,
    ClusterSpec,
    ModelSpec,
    SpecError,
    TrainingSpec,
    as_dict,
    parse,
)

# The cluster's keys the fit sets or rests on: a value given after it (a sweep) leaves half a fit.
FITTED_KEYS = ("matmul_efficiency", "attention_efficiency", "peak_tflops", "memory_efficiency")
# The keys of a profile's ``metadata.config`` (``shardwire train``'s settings) the job is read from.
_JOB_KEYS = ("model", "seq_len", "batch", "grad_accum", "precision", "activation_checkpointing", "compile")
_SHORTEST_S = 1e-6  # no profiled phase of a step is shorter than what a profiler resolves
# How far a profile's FLOPs per token may be from its model's, as the profiler counts them (the same
# count, written as JSON): an edited model name would fit the times of one model to another.
_FLOPS_AGREE = 1e-6


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a profile measured of one rank's step (medians over its steps), and the job it ran."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    ranks: int  # the profiled job's, whose shards the optimizer stepped
    model: ModelSpec
    training: TrainingSpec


def calibrated(cluster: ClusterSpec, measured: Measured, source: str = "a profile") -> ClusterSpec:
    """``cluster`` with its GPU's compute model fitted to ``measured``; raises ``SpecError`` when the
    measurement cannot come from that GPU (faster than its peak, or than its memory-bound work)."""
    arch = architecture(measured.model, measured.training.compute_bytes)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * arch.params / measured.ranks / measured.optimizer_s
    flops_bound = _compute_s(arch, dataclasses.replace(cluster, memory_bandwidth_GBps=None), measured.training)
    memory_bound = _compute_s(arch, cluster, measured.training) - flops_bound
    flops_measured = measured.forward_s + measured.backward_s - memory_bound
    if flops_measured <= 0:
        raise SpecError(f"{source}: its forward and backward ({measured.forward_s + measured.backward_s:.4g} s) "
                        f"take less than their memory-bound work alone at the memory bandwidth of cluster "
                        f"{cluster.name!r} ({memory_bound:.4g} s): was the profile taken of this model and batch, on "
                        f"this GPU?")
    scale = flops_bound / flops_measured
    fitted = {key: getattr(cluster, key) * scale for key in ("matmul_efficiency", "attention_efficiency")}
    if max(fitted.values()) > 1:
        raise SpecError(f"{source}: its compute runs faster than the peak of cluster {cluster.name!r} allows "
                        f"({max(fitted.values()):.2f} of it): give the peak_tflops of the GPU it was measured on")
    if optimizer / 1e9 < MIN_BANDWIDTH_GBPS:
        raise SpecError(f"{source}: its optimizer step ({measured.optimizer_s:.4g} s) streams {optimizer / 1e9:.3g} "
                        f"GB/s, slower than any memory: was the profile taken on this GPU, of the job it names?")
    if cluster.memory_bandwidth_GBps is not None and optimizer > cluster.memory_bandwidth_GBps * 1e9:
        raise SpecError(f"{source}: its optimizer step streams {optimizer / 1e9:.4g} GB/s, more than the memory "
                        f"bandwidth of cluster {cluster.name!r} ({cluster.memory_bandwidth_GBps:g} GB/s) allows: was "
                        f"the profile taken on this GPU, of the job it names?")
    if min(fitted.values()) < MIN_EFFICIENCY:  # the profile's doing, not the cluster's: blamed on it
        raise SpecError(f"{source}: its compute runs at {min(fitted.values()):.2g} of the peak of cluster "
                        f"{cluster.name!r}, slower than any GPU runs its kernels: was the profile taken on this GPU, of the "
                        f"job it names?")
    named = one_line(os.path.basename(os.path.normpath(source)))  # a run directory given as run/ is named
    return parse("cluster", {**as_dict(cluster), **fitted, "optimizer_GBps": optimizer / 1e9,
                             "name": f"{cluster.name} (calibrated by {named})"})


def read_profile(path: str, load_model) -> Measured:
    """The ``Measured`` of a ``profile.json``, or of the run directory holding it (as ``shardwire
    report`` takes it); ``load_model(name, seq_len)`` describes the model its job named (as
    ``shardwire train --model`` takes it). A profile that is not what ``shardwire train --profile``
    wrote (edited, cut short, of another tool) is refused in one line, as ``shardwire report``
    refuses it."""
    remedy = "give the profile.json `shardwire train --profile` wrote, or its --run-dir"
    if os.path.isdir(path):
        if not os.path.lexists(os.path.join(path, PROFILE_FILE)):  # said of the path given, not one made up
            raise SpecError(f"{path} is a directory that holds no {PROFILE_FILE}: {remedy}")
        path = os.path.join(path, PROFILE_FILE)
    try:
        doc = read_profile_document(path)  # checked as `shardwire report` checks it
    except DamagedProfile as err:
        raise SpecError(str(err)) from None
    if analysis.warmup_alone(doc["steps"], doc["warmup_steps"]):  # a summary of warmup, which later steps outrun
        raise SpecError(f"{path} holds only its {len(doc['steps'])} warmup step(s), whose times (allocation, "
                        f"compilation, the first gathers) no later step takes: profile a run of more than "
                        f"{doc['warmup_steps']} steps")
    # the document's check holds its summary's figures and world size to what a profiler writes
    seconds = [doc["summary"]["figures"][f"{phase}_s"]["median"] for phase in ("forward", "backward", "optimizer")]
    try:
        job = {key: field(doc, "metadata", "config", key) for key in _JOB_KEYS}
    except Missing as err:
        raise SpecError(f"profile {path}: {err}, unlike a profile of `shardwire train --profile`; {remedy}") from None
    _check_measured(path, seconds, job["model"], remedy)
    try:
        training = parse("training", {"micro_batch": job["batch"], "grad_accum": job["grad_accum"],
                                      "precision": job["precision"], "compile": job["compile"],
                                      "activation_checkpointing": job["activation_checkpointing"]})
        model = _profiled_model(doc, job, load_model)
    except SpecError as err:
        raise SpecError(f"{path}: its job cannot be simulated: {err}") from None
    # an edited job would be fitted to times another job took (the document holds one that records its length)
    if (differs := tokens_problem(doc, training.micro_batch, training.grad_accum, model.seq_len)) is not None:
        raise SpecError(f"{path} is damaged ({differs}); {remedy}")
    written = doc.get("flops_per_token")  # None where the profiler was given no model description
    arch = architecture(model, compute_bytes=2)  # as the profiler counts them
    recomputed = 1.0 if training.activation_checkpointing else 0.0
    for kind, expected in (("model", arch.model_flops), ("hardware", arch.hardware_flops(recomputed))):
        counted = written.get(kind) if isinstance(written, dict) else None
        if is_number(counted) and not math.isclose(counted, expected / model.seq_len, rel_tol=_FLOPS_AGREE):
            raise SpecError(f"{path} is damaged (its {kind} flops_per_token, {counted:.4g}, are not those of its "
                            f"job, {cut(str(job['model']))}{' recomputing every block' if recomputed else ''}, which "
                            f"does {expected / model.seq_len:.4g} a token: a profile of another job, one edited, or "
                            f"an hf: model directory other than the one it names from here); {remedy}")
    if doc["world_size"] > 1:
        warnings.warn(f"{path} is a profile of {doc['world_size']} ranks, whose forward and backward ran beside "
                      f"their collectives, slower by what those took from compute: the fit counts that as the GPU's "
                      f"own; a profile of one rank fits the compute alone", stacklevel=2)
    return Measured(*seconds, ranks=_optimizer_ranks(path, doc, remedy), model=model, training=training)


def _optimizer_ranks(path: str, doc: dict, remedy: str) -> int:
    """The ranks the profiled job split each optimizer state over (its step streams one share): as
    recorded, or for a profile that predates the record, as its layout splits them; but a hybrid
    group's default size, a node's ranks, which such a profile does not hold."""
    world, job = doc["world_size"], doc["metadata"]["config"]
    ranks = doc["metadata"].get("optimizer_ranks")
    if ranks is None and world > 1:
        layout, size = job.get("layout"), job.get("shard_group_size")
        if layout == "hybrid" and size is None:
            raise SpecError(f"{path} does not say how many ranks its {world} ranks' optimizer states were split "
                            f"over (layout hybrid, in groups of a node's ranks, on nodes it does not name): profile "
                            f"the job again, or profile one rank")
        try:
            ranks = LayoutPlan.make(layout, size, world, world).split_over
        except ValueError as err:
            raise SpecError(f"{path} is damaged (its job's layout cannot run: {err}); {remedy}") from None
    if ranks is None:
        return 1
    if type(ranks) is not int or not 1 <= ranks <= world or world % ranks:
        raise SpecError(f"{path} is damaged (its metadata's optimizer_ranks is {cut(json.dumps(ranks), 60)}, not a whole "
                        f"number of ranks dividing its world_size, {world}); {remedy}")
    return ranks


def _profiled_model(doc: dict, job: dict, load_model) -> ModelSpec:
    """The model a profile measured: the description it records, where it holds one (an ``hf:``
    directory edited since names another model, with another optimizer's work where only a head's
    tying changed), else its job's model as it reads now."""
    recorded = doc["metadata"].get("model_spec")
    if recorded is None:
        return load_model(job["model"], job["seq_len"])
    return parse("model", recorded)


def _check_measured(path: str, seconds: list, model, remedy: str) -> None:
    """Refuse values of the job no profile holds (its document checked, ``read_profile_document``)
    before any arithmetic is done with them: a phase shorter than a profiler resolves, a model that
    is not a name would fail deep inside the fit."""
    if min(seconds) < _SHORTEST_S:
        raise SpecError(f"{path}: its forward, backward and optimizer times must be seconds of at least "
                        f"{_SHORTEST_S:g} (a profiler's resolution), got {shown(seconds)}; {remedy}")
    if not isinstance(model, str):
        raise SpecError(f"{path}: its model must be a name, as `shardwire train --model` takes it, got "
                        f"{shown(model)}; {remedy}")


def _compute_s(arch: Architecture, cluster: ClusterSpec, training: TrainingSpec) -> float:
    """Forward and backward of a step on one GPU, as the compute model times them."""
    units = (arch.root, *arch.units)
    return training.grad_accum * sum(forward_s(u, cluster, training) + backward_s(u, cluster, training)
                                     for u in units)

