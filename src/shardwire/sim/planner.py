"""``plan``: the fastest settings that fit, for a model, a cluster and a global batch.

The global batch fixes the samples each GPU processes per step; the planner searches how to run
them: the micro-batch (every divisor of the per-GPU batch, the rest made up by gradient
accumulation), the layout (full, grad_op, and on several nodes hybrid, hybrid without
resharding after forward and hybrid_secondary, in groups of a node's GPUs), the prefetch depth (0
to ``MAX_PREFETCH``), activation checkpointing and, on several nodes, the wire (``WIRES``: exact,
int8, or int8 parameters with int4 gradients, in blocks of the default size with error feedback;
``HYBRID_WIRES`` for the hybrid layout, whose parameters never cross nodes; on one node no
collective crosses nodes, so the wire changes nothing and only "none" is tried). A quantized wire
is lossy (the step computes with quantized weights or reduces quantized gradients): ``exact``
searches exact collectives only. The precision and compilation come from the base training
configuration (bf16 becomes fp16 on a GPU without bf16 tensor cores, as the V100, and
``Plan.notes`` says so); the rest is what the engine runs (its sliding window, reductions in fp32,
gradient accumulation under ``no_sync``; no ``fault_tolerance``, which applies to hybrid alone, and
``Plan.notes`` says so where the base asked for it), so that every configuration the planner names is one ``shard()``
and ``shardwire train`` run: ``launch`` gives the command and the arguments for both, and says why
where the engine cannot run it (fp8 gathers, a model ``shardwire train`` does not name). Candidates
whose memory does not fit are not simulated; the rest are ranked by step time, ties (within
``TIE``) going to the one that needs less memory (an exact wire keeps no error feedback). Where
their unit passes add up past ``MAX_SEARCH_PASSES`` (a large per-GPU batch), each setting of the
rest keeps its largest micro-batches that fit, and ``Plan.notes`` says so.

The explanation sets the winner against what changing each of its settings alone would give:
slower, or not fitting, which is why it wins; and names the runner-up.

DiLoCo, syncing every H steps (hybrid groups that train apart, ``shardwire.engine.diloco``), is
searched apart, on several nodes: it changes the optimisation, not only the step, so it never wins in
place of synchronous training; the plan offers its fastest configuration beside the winner
(``diloco``), with that caveat. Quantized wires change the optimisation too, if within a quantization's error:
``exact`` leaves out both.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

from shardwire.launch import torchrun_command
from shardwire.mappings import shown
from shardwire.sim.gpt_sizes import BYTE_VOCAB
from shardwire.sim.gpt_sizes import PRESETS as GPT_SIZES
from shardwire.options import command_line
from shardwire.sim.architecture import architecture
from shardwire.sim.memory import GIB, MemoryEstimate, estimate_memory
from shardwire.sim.predict import Prediction, predict
from shardwire.sim.specs import (MAX_BATCH, MAX_GRAD_ACCUM, ClusterSpec, ModelSpec, SpecError, TrainingSpec, as_dict,
                                 parse, spelled)
from shardwire.sim.huggingface import HF_PREFIX, has_tokenizer
from shardwire.sim.step import MAX_UNIT_PASSES, layout_plan, unit_passes

MAX_PREFETCH = 4
# The unit passes a plan simulates in all, at about 0.1 ms each: past this, a large per-GPU batch
# (every divisor a micro-batch, each of its micro-batches simulated in full) took minutes.
MAX_SEARCH_PASSES = 2**18
# Step times this close count as equal, and the configuration needing less memory wins.
TIE = 1e-3

# (layout, reshard_after_forward): full with no resharding is grad_op, so it is not listed twice;
# hybrid_secondary without resharding never gathers for backward, so it is grad_op too.
_LAYOUTS = (("full", True), ("grad_op", False), ("hybrid", True), ("hybrid", False), ("hybrid_secondary", True))
_HYBRID = ("hybrid", "hybrid_secondary")
# Wire formats, as ``shardwire train --wire`` and ``shard(wire=...)`` take them: exact, the smallest
# quantization of both, and the smallest wire (ZeRO++'s qwZ and qgZ); for the hybrid layout, whose
# gathers stay within a node's group and never quantize, the same for gradients alone.
WIRES = ("none", "int8", "params=int8,grads=int4")
HYBRID_WIRES = ("none", "grads=int8", "grads=int4")
# DiLoCo, as ``shardwire train --diloco`` takes it, for the hybrid layout (in and out of resharding):
# its defaults, whose cost in validation loss at equal tokens BENCHMARKS.md measures.
DILOCOS = ("sync_every=20",)


@dataclasses.dataclass(frozen=True)
class Alternative:
    """The winner with one setting changed: how it fares."""

    change: str
    step_time_s: float | None  # None when it does not fit
    memory: MemoryEstimate


@dataclasses.dataclass
class Plan:
    best: Prediction
    runner_up: Prediction | None
    alternatives: list[Alternative]
    candidates: int
    fitting: int
    diloco: Prediction | None = None  # the fastest that syncs every H steps (DiLoCo) instead, where offered
    notes: list[str] = dataclasses.field(default_factory=list)  # what the search changed in the base training
    searched: list[str] = dataclasses.field(default_factory=list)  # the settings searched, in words


@dataclasses.dataclass(frozen=True)
class Launch:
    """How to run a planned configuration: the ``torchrun`` command each node runs (None where
    ``shardwire train`` cannot run it, and ``unrunnable`` says why), what the user must add to it
    (``needs``: the data, where the default corpus cannot feed the model), the ``shardwire train``
    options it holds, the ``shard(...)`` arguments, and why the configuration is lossy, if it is."""

    command: str | None
    train_options: list[str]
    shard_arguments: dict
    unrunnable: str | None
    lossy: str | None
    needs: str | None = None


def check_global_batch(global_batch: int, cluster: ClusterSpec) -> None:
    """Refuse a global batch out of range or that does not divide over ``cluster``'s GPUs, naming
    the nearest that do (``SpecError``): before any search, and before ``--print-config`` prints."""
    if global_batch < 1:
        raise SpecError(f"--global-batch must be at least 1, got {shown(global_batch)}")
    if global_batch > MAX_BATCH:
        raise SpecError(f"--global-batch {shown(global_batch)} is over {MAX_BATCH:,} sequences, hundreds of times the "
                        f"largest published batches: it counts sequences, not tokens")
    world = cluster.world
    if global_batch % world:
        lower, upper = global_batch // world * world, (global_batch // world + 1) * world
        raise SpecError(
            f"global batch {global_batch} does not divide over {world} GPUs; the nearest that do are "
            f"{', '.join(str(b) for b in (lower, upper) if b > 0)}"
        )


def plan(model: ModelSpec, cluster: ClusterSpec, global_batch: int, base: TrainingSpec, *,
         exact: bool = False, fixed: Mapping[str, object] | None = None) -> Plan:
    """Search the settings (``exact``: exact collectives only, and no DiLoCo offered; ``fixed``:
    settings held at these values, as a run that plans itself holds its batch); raises
    ``SpecError`` when the batch is out of range or does not divide, or nothing fits."""
    check_global_batch(global_batch, cluster)
    world = cluster.world
    per_gpu = global_batch // world
    notes = []
    if base.precision == "bf16" and not cluster.bf16:
        base = dataclasses.replace(base, precision="fp16")
        notes.append(f"precision fp16: the cluster's GPU ({cluster.gpu}) has no bf16 tensor cores, so 16-bit mixed "
                     f"precision on it is fp16")
    if base.fault_tolerance:  # it applies to hybrid alone, and the search tries every layout on the same footing
        notes.append("fault_tolerance: searched without it (it changes nothing of the step but memory, and applies "
                     "to layout hybrid alone); simulate the plan's hybrid settings with it to price it")
    if base.layout == "zero1":  # a run described as another tool ran it: the search is over the engine's layouts
        base = dataclasses.replace(base, layout="full", shard_group_size=None, reduce_bucket_elements=None)
        notes.append("layout zero1: searched over the layouts shardwire runs instead (zero1 describes runs of "
                     "other tools; simulate it to compare)")
    wires = cluster.nodes > 1 and not exact  # whether quantized wires are searched
    default = TrainingSpec()
    given = {key: getattr(base, key) for key in _SEARCHED
             if key not in (fixed or {}) and getattr(base, key) != getattr(default, key)}
    if given.get("wire", "none") != "none" and not wires:
        notes.append(f"wire {spelled(given.pop('wire'))}: searched with exact collectives only ("
                     f"{'--exact' if exact else 'on one node no collective crosses nodes'}); simulate the wire given "
                     f"to price it")
    if given:
        notes.append(f"{', '.join(f'{key} {spelled(value)}' for key, value in given.items())}: the plan searches "
                     f"{'it' if len(given) == 1 else 'these'} itself; simulate the settings given to price them")
    if base.shard_group_size is not None:
        groups = (f"searched with hybrid groups of a node's {cluster.gpus_per_node} GPUs, as the plan's command "
                  f"runs them" if cluster.nodes > 1 else "on one node no hybrid layout is searched")
        notes.append(f"shard_group_size {base.shard_group_size}: {groups}; simulate the size given to price it")
    if base.diloco != "none":
        offered = ("offered as DiLoCo's published setting (diloco " + ", ".join(DILOCOS) + ")"
                   if not exact and cluster.nodes > 1 else
                   "not offered (" + ("--exact" if exact else "one node has no groups to sync") + ")")
        notes.append(f"diloco {spelled(base.diloco)}: syncing every H steps is {offered}; simulate the settings "
                     f"given to price them")
    if replaced := {key: value for key, value in as_dict(base).items()
                    if key in _NOTED_ENGINE_SETTINGS and value != _ENGINE_SETTINGS[key]}:
        given = ", ".join(f"{key} {spelled(value)}" for key, value in replaced.items())
        engine = ", ".join(f"{key} {spelled(_ENGINE_SETTINGS[key])}" for key in replaced)
        notes.append(f"{given}: searched as shardwire's engine runs ({engine}), which the plan's command runs; "
                     f"simulate the settings given to price them")
    layout_plan(cluster, base)  # the search sets the layout; a setting given that cannot run is refused
    candidates = [t for t in candidate_settings(per_gpu, cluster, base, exact=exact) if _holds(t, fixed)]
    if not candidates:
        raise SpecError(f"no configuration holds {', '.join(f'{key} {value}' for key, value in fixed.items())} "
                        f"with {per_gpu} samples per GPU")
    arch = architecture(model, base.compute_bytes)
    # the micro-batches of a single sequence of a model of thousands of layers: more than one prediction schedules
    candidates = [t for t in candidates if unit_passes(arch, t) <= MAX_UNIT_PASSES]
    if not candidates:
        raise SpecError(f"every configuration of {model.name} with {per_gpu} samples per GPU holding what is fixed "
                        f"schedules more than {MAX_UNIT_PASSES:,} unit passes a step (units x micro-batches), more "
                        f"than the simulator prices: give a smaller global batch, or fix a larger micro-batch")
    memory = {t: estimate_memory(arch, cluster, t) for t in candidates}
    fitting = [t for t in candidates if memory[t].fits]
    if not fitting:
        smallest = min(candidates, key=lambda t: memory[t].total)
        need = memory[smallest]
        raise SpecError(
            f"no configuration of {model.name} with {per_gpu} samples per GPU fits in {cluster.gpu_memory_gb:g} GiB: "
            f"the smallest ({describe_settings(smallest)}) needs {need.total / GIB:.1f} GiB per GPU, "
            f"{need.shortfall / GIB:.1f} GiB more than the {need.usable / GIB:.1f} usable; use more GPUs "
            f"or a smaller global batch"
        )
    simulated, left_out = _affordable(fitting, arch)
    if left_out is not None:
        notes.append(_left_out(left_out))
    ranked = [predict(model, cluster, t) for t in simulated]
    while True:
        ranked = _ranked(ranked)
        best = ranked[0]
        by_training = {p.training: p for p in ranked}
        alternatives, alone = [], []
        for change, t in _one_changes(best.training, candidates):
            p = by_training.get(t)
            if p is None and memory[t].fits:  # left out of the search for its cost: priced alone
                p = predict(model, cluster, t)
                alone.append(p)
            alternatives.append(Alternative(change, None if p is None else p.step_time_s, memory[t]))
        if all(p.step_time_s >= best.step_time_s for p in alone):
            break
        ranked += alone  # one left out is faster after all: ranked with the rest, and explained again
    diloco = None
    if not exact and cluster.nodes > 1:
        syncing, left_out = _affordable([t for t in diloco_settings(per_gpu, cluster, base) if _holds(t, fixed)
                                         and unit_passes(arch, t) <= MAX_UNIT_PASSES
                                         and estimate_memory(arch, cluster, t).fits], arch)
        if left_out is not None:
            notes.append(f"diloco: {_left_out(left_out)}")
        diloco = min((predict(model, cluster, t) for t in syncing), key=lambda p: p.step_time_s, default=None)
    searched = [word for key, word in _SEARCHED.items() if word is not None and (key != "wire" or wires)]
    return Plan(best, ranked[1] if len(ranked) > 1 else None, alternatives, len(candidates), len(fitting), diloco,
                notes, searched)


def _left_out(sizes: int) -> str:
    """What a search kept to ``MAX_SEARCH_PASSES`` left out (``_affordable``)."""
    kept = "its largest micro-batch" if sizes == 1 else f"its {sizes} largest micro-batches"
    return (f"each setting of the rest (layout, prefetch, checkpointing, wire) simulated only with {kept} that "
            f"fit: smaller ones of the same settings are slower, and their many micro-batches a step would take the "
            f"search minutes")


def _ranked(predictions: list[Prediction]) -> list[Prediction]:
    """``predictions`` by step time, the best first: of those within ``TIE`` of the fastest, the one
    needing least memory."""
    ranked = sorted(predictions, key=lambda p: p.step_time_s)
    ties = [p for p in ranked if p.step_time_s <= ranked[0].step_time_s * (1 + TIE)]
    best = min(ties, key=lambda p: p.memory.total)
    ranked.remove(best)
    return [best, *ranked]


def _affordable(fitting: list[TrainingSpec], arch) -> tuple[list[TrainingSpec], int | None]:
    """The configurations of ``fitting`` the search simulates, and how many micro-batch sizes it
    kept of each setting of the rest (None: all): all, unless their unit passes add up to more than
    ``MAX_SEARCH_PASSES``; then, for each setting of the rest (layout, prefetch, checkpointing,
    wire), its largest micro-batch that fits, then its next largest, and so on, while the total
    stays within it (the largest of each at least). At the same settings, a smaller micro-batch of
    the same samples is rarely faster: it runs more gathers and reductions a step, and the matrix
    multiplies no faster; across settings it may be (one that fits without checkpointing)."""
    rests: dict[TrainingSpec, list[TrainingSpec]] = {}
    for t in sorted(fitting, key=lambda t: -t.micro_batch):
        rests.setdefault(dataclasses.replace(t, micro_batch=1, grad_accum=1), []).append(t)
    kept, total, sizes = [], 0, 0
    while layer := [by_size[sizes] for by_size in rests.values() if len(by_size) > sizes]:
        total += sum(unit_passes(arch, t) for t in layer)
        if kept and total > MAX_SEARCH_PASSES:
            return kept, sizes
        kept += layer
        sizes += 1
    return kept, None


def _holds(t: TrainingSpec, fixed: Mapping[str, object] | None) -> bool:
    return fixed is None or all(getattr(t, key) == value for key, value in fixed.items())


def describe_settings(t: TrainingSpec) -> str:
    """The searched settings of ``t``, as the plan and its errors name them."""
    return (f"micro-batch {t.micro_batch}, grad_accum {t.grad_accum}, layout {_layout(t)}, prefetch {t.prefetch}, "
            f"activation checkpointing {'on' if t.activation_checkpointing else 'off'}, wire {t.wire}"
            + ("" if t.diloco == "none" else f", diloco {t.diloco}"))


def _divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending, found in pairs up to its square root: a huge batch must not make
    the search count to it."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


# The settings the search sets (``_settings``), a value the base gives for one not held, with their
# words on the plan's search line (the accumulation follows the micro-batch; the wire is searched
# where quantized ones are).
_SEARCHED = {"micro_batch": "micro-batch", "grad_accum": None, "layout": "layout",
             "reshard_after_forward": "resharding", "prefetch": "prefetch", "activation_checkpointing": "checkpointing",
             "wire": "wire"}


def _settings(per_gpu: int, cluster: ClusterSpec, exact: bool):
    micro_batches = [m for m in _divisors(per_gpu) if per_gpu // m <= MAX_GRAD_ACCUM]
    layouts = [s for s in _LAYOUTS if s[0] not in _HYBRID or cluster.nodes > 1]
    for micro, (layout, reshard), prefetch, checkpointing in itertools.product(
        micro_batches, layouts, range(MAX_PREFETCH + 1), (False, True)
    ):
        wires = (HYBRID_WIRES if layout == "hybrid" else WIRES) if cluster.nodes > 1 and not exact else ("none",)
        for wire in wires:
            yield dict(micro_batch=micro, grad_accum=per_gpu // micro, layout=layout,
                       reshard_after_forward=reshard, prefetch=prefetch, activation_checkpointing=checkpointing,
                       wire=wire)


def candidate_settings(per_gpu: int, cluster: ClusterSpec, base: TrainingSpec, *,
                       exact: bool = False) -> list[TrainingSpec]:
    """Every synchronous configuration the planner considers for ``per_gpu`` samples per GPU and step
    (with ``exact``, no quantized wire)."""
    return [_training(base, **settings) for settings in _settings(per_gpu, cluster, exact)]


def diloco_settings(per_gpu: int, cluster: ClusterSpec, base: TrainingSpec) -> list[TrainingSpec]:
    """The configurations that sync every H steps (``DILOCOS``): the hybrid ones, exact otherwise."""
    return [_training(base, **settings, diloco=diloco) for settings in _settings(per_gpu, cluster, exact=True)
            if settings["layout"] == "hybrid" for diloco in DILOCOS]


# What the engine runs of the settings a training spec may give otherwise (the search sets the
# layout's group, DiLoCo and fault tolerance apart): a plan is of what its command runs. Those a user
# gives otherwise are said to be searched so, as the engine runs them.
_ENGINE_SETTINGS = {"limiter": "sliding", "gathers_per_unit": 1, "reduce_precision": "fp32", "shard_group_size": None,
                    "recompute_fraction": None, "reduce_each_micro_batch": False, "reduce_bucket_elements": None,
                    "diloco": "none", "fault_tolerance": False}
_NOTED_ENGINE_SETTINGS = ("limiter", "gathers_per_unit", "reduce_precision", "recompute_fraction",
                          "reduce_each_micro_batch")


def _training(base: TrainingSpec, **settings) -> TrainingSpec:
    return parse("training", {**as_dict(base), **_ENGINE_SETTINGS, **settings, "name": "planned"})


def runnable(t: TrainingSpec, cluster: ClusterSpec) -> tuple[list[str], dict]:
    """The ``shardwire train`` options and the ``shard(...)`` arguments that run ``t`` on ``cluster``
    (what is not the engine's, the batch and the launch, only in the former)."""
    plan = layout_plan(cluster, t)  # grad_op runs as full, kept gathered
    layout = plan.name
    shard_args = {"layout": layout}
    if plan.grouped:
        shard_args["shard_group_size"] = plan.group
    # fp8: the model's linear layers converted first (shardwire.models.fp8), computing in bf16 around them
    precision = "bf16" if t.precision == "fp8" else t.precision
    shard_args |= {"reshard_after_forward": t.reshards, "prefetch": t.prefetch, "mixed_precision": precision,
                   "activation_checkpointing": t.activation_checkpointing, "wire": t.wire}
    if t.compile:
        shard_args["compile"] = True
    diloco = None if t.diloco == "none" else t.diloco
    if diloco is not None:
        shard_args["diloco"] = diloco
    options = command_line({"batch": t.micro_batch, "grad_accum": t.grad_accum, "layout": layout,
                            "shard_group_size": shard_args.get("shard_group_size"), "reshard": t.reshards,
                            "prefetch": t.prefetch, "precision": t.precision,
                            "activation_checkpointing": t.activation_checkpointing, "compile": t.compile,
                            "wire": t.wire, "diloco": diloco})
    return options, shard_args


def launch(t: TrainingSpec, cluster: ClusterSpec, model: ModelSpec, model_argument: str) -> Launch:
    """How to run ``t`` of ``model`` (named ``model_argument`` on the command line) on ``cluster``:
    each node runs the same ``torchrun`` command, meeting the others at the first node's address."""
    options, shard_args = runnable(t, cluster)
    model_argument = _as_trained(model, model_argument)
    unrunnable = _unrunnable(t, model_argument)
    command = None
    if unrunnable is None:
        job = ["train", "--model", model_argument, "--seq-len", str(model.seq_len), *options]
        command = torchrun_command(cluster.nodes, cluster.gpus_per_node, job)
    return Launch(command, options, shard_args, unrunnable, _lossy(t), _needs(model, model_argument))


def _needs(model: ModelSpec, model_argument: str) -> str | None:
    """What ``shardwire train --model model_argument`` needs beside the plan's options: its default
    corpus is text, read as bytes (ids 0 to 255), or by the tokenizer of an ``hf:`` model's
    directory; any other vocabulary needs data of its own."""
    if model.vocab == BYTE_VOCAB or not model_argument.startswith(HF_PREFIX):
        return None
    if has_tokenizer(model_argument[len(HF_PREFIX):]):
        return None
    return (f"--data: the model's {model.vocab:,} ids are its tokenizer's, and the default corpus is text read as "
            f"bytes: give --data pre-tokenised ids (.bin or .npy), or text with --tokenizer DIR")


def _as_trained(model: ModelSpec, model_argument: str) -> str:
    """The ``--model`` of ``shardwire train`` for ``model``: ``model_argument``, or the GPT size that a
    mapping changed in its sequence length alone names (the command gives ``--seq-len``)."""
    if model_argument in GPT_SIZES or model_argument.startswith(HF_PREFIX):
        return model_argument

    def shape(spec: ModelSpec) -> dict:
        return {key: value for key, value in as_dict(spec).items() if key not in ("name", "seq_len")}

    return next((name for name, size in GPT_SIZES.items() if shape(size.spec(name)) == shape(model)), model_argument)


def _unrunnable(t: TrainingSpec, model_argument: str) -> str | None:
    """Why ``shardwire train`` cannot run ``t`` of the model ``model_argument`` names, or None."""
    if not (model_argument in GPT_SIZES or model_argument.startswith(HF_PREFIX)):
        return (f"shardwire train names no model {model_argument!r}: plan --model with one of its GPT sizes "
                f"({', '.join(GPT_SIZES)}) or hf:CONFIG (a Hugging Face config.json of the architecture)")
    if t.precision == "fp8" and t.fp8_all_gather:
        return ("the engine gathers fp8 layers' weights in bf16, not in fp8: this configuration (fp8 gathers) is "
                "simulated, not run")
    return None


def _lossy(t: TrainingSpec) -> str | None:
    """What a quantized wire changes in the step, or None for exact collectives."""
    wire = t.wire_format
    quantized = [what for what, codec in (("parameters", wire.param_codec), ("gradients", wire.grad_codec)) if codec]
    if not quantized:
        return None
    return (f"lossy: the wire quantizes {' and '.join(quantized)} between nodes ({t.wire}); "
            f"plan --exact for exact collectives only")


def shard_call(t: TrainingSpec, cluster: ClusterSpec) -> str:
    """The library's calls that run ``t``: ``shard(...)``, after converting the units' linear layers
    where it computes in fp8."""
    _, kwargs = runnable(t, cluster)
    call = "shardwire.shard(model, " + ", ".join(f"{key}={value!r}" for key, value in kwargs.items()) + ")"
    return f"shardwire.models.fp8.convert(model, units); {call}" if t.precision == "fp8" else call


def _dimensions(t: TrainingSpec) -> dict:
    return {"micro_batch": t.micro_batch, "layout": (t.layout, t.reshards), "prefetch": t.prefetch,
            "checkpointing": t.activation_checkpointing, "wire": t.wire}


def _one_changes(best: TrainingSpec, candidates: list[TrainingSpec]):
    """(label, candidate) for each candidate that differs from ``best`` in one searched setting;
    for the micro-batch and the prefetch depth, only the nearest value on either side."""
    mine = _dimensions(best)
    nearest: dict[tuple[str, bool], tuple[int, TrainingSpec]] = {}
    for t in candidates:
        theirs = _dimensions(t)
        changed = [key for key in mine if theirs[key] != mine[key]]
        if len(changed) != 1:
            continue
        key = changed[0]
        if key in ("micro_batch", "prefetch"):
            side = (key, theirs[key] > mine[key])
            distance = abs(theirs[key] - mine[key])
            if side not in nearest or distance < nearest[side][0]:
                nearest[side] = (distance, t)
        else:
            yield _change(best, t), t
    for _, t in nearest.values():
        yield _change(best, t), t


def _change(best: TrainingSpec, other: TrainingSpec) -> str:
    if other.layout != best.layout or other.reshards != best.reshards:
        return f"layout {_layout(other)}"
    if other.micro_batch != best.micro_batch:
        return f"micro-batch {other.micro_batch}, grad_accum {other.grad_accum}"
    if other.prefetch != best.prefetch:
        return f"prefetch {other.prefetch}"
    if other.wire != best.wire:
        return f"wire {other.wire}"
    return f"activation checkpointing {'on' if other.activation_checkpointing else 'off'}"


def _layout(t: TrainingSpec) -> str:
    if t.layout == "hybrid" and not t.reshards:
        return "hybrid (no reshard after forward)"
    return t.layout
