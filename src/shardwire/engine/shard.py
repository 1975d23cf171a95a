"""``shard()``: turn a model into a fully sharded one, in place."""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp._flat_param import FlatParameter
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from shardwire import worker
from shardwire.comm import groups
from shardwire.comm.communicator import Communicator
from shardwire.comm.wire import Wire
from shardwire.engine import guards, materialize, sharded_state_dict
from shardwire.engine.diloco import DiLoCo
from shardwire.engine.fault_tolerance import FaultTolerance, check_fault_tolerance
from shardwire.engine.flat_param import FlatParam
from shardwire.engine.layout import Layout
from shardwire.engine.layout_plan import LayoutPlan
from shardwire.engine.mixed_precision import MixedPrecision
from shardwire.engine.packing import Packing
from shardwire.engine.runtime import Engine
from shardwire.engine.selection import OwnedParam, UnitSpec, assign_params, select_units, state_dict_names
from shardwire.engine.unit import Unit
from shardwire.launch import tells_the_user
from shardwire.mappings import cut, shown
from shardwire.options import MAX_TIMEOUT_S
from shardwire.renamed import renamed_keywords

_ENGINE_ATTR = "_shardwire_engine"


@renamed_keywords({"sync": "diloco", "sharding": "layout"},
                  notes={"sync": " (every -> sync_every, overlap -> fragment_sync_delay)"})
def shard(
    model: nn.Module,
    *,
    units: UnitSpec = None,
    reshard_after_forward: bool = True,
    prefetch: int = 2,
    mixed_precision: MixedPrecision | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    layout: str = "full",
    shard_group_size: int | None = None,
    wire: Wire | str | None = None,
    diloco: DiLoCo | str | None = None,
    fault_tolerance: FaultTolerance | str | None = None,
    activation_checkpointing: bool = False,
    compile: bool | Mapping[str, Any] = False,
    timeout: float = 600.0,
    device: torch.device | str | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Shard ``model`` over the ranks of ``process_group`` in place, and return it.

    Each unit's parameters (``units``: module classes or a predicate; by default the blocks of the
    model's ``nn.ModuleList``s) become one flat buffer of which this rank keeps an equal shard, its
    rows of each parameter, cut from rank 0's values (as DDP does at construction), so every rank
    starts from the same model; everything outside the units forms the root unit. Afterwards the
    model keeps its own parameters, names and ``requires_grad`` flags, each a DTensor of the
    parameter's full shape split by rows (``Shard(0)``), as FSDP2's ``fully_shard`` leaves them,
    whose local tensor is this rank's rows in the shard. So torch's own tools work as they do under
    FSDP2: any ``torch.optim`` optimizer built from ``model.parameters()``, in any param groups
    (``p.dim()`` and ``p.shape`` are the model's), ``torch.nn.utils.clip_grad_norm_``, and
    ``get_state_dict`` and DCP for the model and its optimizer.

    Set ``requires_grad`` before sharding: frozen parameters go into buffers of their own, gathered
    but never reduced, and changing the flag afterwards is an error at the next forward.

    A model built on the meta device (``with torch.device("meta"): model = ...``) is made here, a
    unit at a time, so that no rank ever holds it whole: each module's parameters and buffers get
    storage on ``device`` and are initialised by ``init``, children first, as ``model.apply(init)``
    would, with the values the whole model so initialised would have (``shardwire.engine.materialize``).

    Args:
        reshard_after_forward: release each unit's gathered parameters after its forward and gather
            them again for its backward (less memory, one more all-gather per unit and step), except
            the units backward gathers as it opens (the first ``max(1, prefetch)`` of its order),
            which its opening holds at the same time as every activation anyway.
        prefetch: the most units gathered ahead of the one running (0: gather only on demand).
        mixed_precision: ``None``/"fp32", "bf16", "fp16" or a ``MixedPrecision``.
        process_group: defaults to the world, which is created if needed (torchrun's, or one process,
            with ``timeout``). The engine works on the device of the model's parameters, whatever the
            current CUDA device is.
        layout: "full" (every buffer split over all ranks), "hybrid" (split within groups of
            ``shard_group_size`` ranks, replicated across groups, gradient shards all-reduced
            between them) or "hybrid_secondary" (ZeRO++'s hpZ: split over all ranks, backward
            gathering from a copy split within the group). See ``shardwire.engine.layout_plan``.
        shard_group_size: the ranks of a group, a divisor of the process group's size; by default
            the ranks of a node (torchrun's ``LOCAL_WORLD_SIZE``, or SLURM's tasks per node where
            the world is an srun job step's tasks: ``shardwire.placement.launch_ranks_per_node``).
        wire: what gathers and reductions send between nodes: ``None`` (the compute and reduce
            dtypes), "int8" (int8 parameters and gradients), or a ``shardwire.Wire`` (say,
            ``Wire(params="int8", grads="int4")``). Only collectives whose group spans nodes
            quantize; master weights and optimizer state never do. See ``shardwire.comm.wire``.
        diloco: under ``layout="hybrid"``, let the groups train apart and average their parameters'
            change every H steps instead of their gradients at every step (DiLoCo; Streaming DiLoCo
            with ``fragments``): a ``shardwire.DiLoCo``, or its string form ("sync_every=50,
            fragments=4,wire=int4"). It changes the optimisation. See ``shardwire.engine.diloco``.
        fault_tolerance: under ``layout="hybrid"``, make this job (all of ``process_group``'s
            ranks) one group of many that survive each other: the groups meet through a torchft
            lighthouse at each sync (with ``diloco``) or at every step (averaging gradients, as
            hybrid's groups do: fault-tolerant HSDP), a lost group is left out and one that comes
            back receives the others' state. A ``shardwire.FaultTolerance`` or its string form
            ("lighthouse=http://head:29510,group=node-3"); ``shardwire.recover_with`` names what else
            a recovering group receives.
            See ``shardwire.engine.fault_tolerance``.
        activation_checkpointing: recompute each unit's activations in backward instead of keeping them.
        compile: compile each unit's computation with ``torch.compile``, as torchtitan compiles its
            blocks: True, or a dict of torch.compile's keyword arguments (``{"mode": "max-autotune"}``;
            ``fullgraph`` is True unless given). Only a unit's own ``forward`` (with its checkpoint) is
            compiled, between the engine's hooks, so gathers, reductions and their checks run eagerly
            around the compiled graph; the root unit runs eagerly.
        timeout: seconds a collective may take before it becomes an error naming the rank and unit.
            On NCCL the process group's own timeout applies: create it with the same one.
        device: where a model built on the meta device is made: by default the current CUDA device
            under NCCL and the CPU under gloo. A model with storage stays where it is.
        init: what initialises each module of a model built on the meta device, ``fn(module)`` as for
            ``model.apply``: by default a Hugging Face model's own initialisation, and otherwise each
            module's ``reset_parameters()``. The package's GPT takes ``init=model.init_module``.

    ``diloco`` was ``sync`` before torchft's name (``sync`` read as the opposite of ``no_sync``),
    ``layout`` was ``sharding``: either old name is taken as the new one, with a warning, for a
    release (``shardwire.renamed.renamed_keywords``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes the model, an nn.Module, got {type(model).__name__}")
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this rank is not in process_group (torch.distributed.new_group gives the ranks outside "
                         "a group a placeholder): call shard only on the group's own ranks")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    _check_not_sharded(model)
    current = _single_device(model)
    on_meta = current.type == "meta"
    device = _device(current, device, init, process_group)
    policy = MixedPrecision.parse(mixed_precision)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative integer (units gathered ahead), got {shown(prefetch)}")
    reshard_after_forward = _flag("reshard_after_forward", reshard_after_forward,
                                  " (FSDP2's integer, resharding to a smaller group, is layout='hybrid_secondary' here)")
    activation_checkpointing = _flag("activation_checkpointing", activation_checkpointing)
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
            and 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:,} (a "
                         f"year), got {timeout!r}")
    wire = Wire.parse(wire)
    diloco = DiLoCo.parse(diloco)
    fault_tolerance = FaultTolerance.parse(fault_tolerance)
    compile_options = _compile_options(compile)
    deadline = datetime.timedelta(seconds=timeout)
    if process_group is None:
        worker.ensure_initialized(device, deadline)
        process_group = dist.group.WORLD
    worker.check_backend_serves(process_group, device)
    world = dist.get_world_size(process_group)
    per_node = groups.placement_of(process_group).ranks_per_node
    check_fault_tolerance(fault_tolerance, diloco, layout, shard_group_size, world)
    # A fault-tolerant job is one group, however many ranks it has.
    plan = LayoutPlan.make(layout, shard_group_size, world, per_node, diloco=diloco,
                           one_group=fault_tolerance is not None)
    if (layout != "full" and shard_group_size is None and plan.group == world and fault_tolerance is None
            and tells_the_user()):  # once, not once per rank (a command says it in its own words)
        local = os.environ.get("LOCAL_WORLD_SIZE")
        why = (f"torchrun's LOCAL_WORLD_SIZE is {local}" if local is not None else
               "torchrun's LOCAL_WORLD_SIZE is not set, and no SLURM job step of these ranks spreads them evenly "
               "over several nodes")
        warnings.warn(
            f"layout={layout!r} takes its groups from the ranks of a node, and here all {world} ranks "
            f"form one ({why}): that is the full layout. Pass shard_group_size, or launch with torchrun "
            f"--nnodes N --nproc-per-node M, or srun --nodes N --ntasks-per-node M",
            stacklevel=2,
        )

    state_dict_keys = state_dict_names(model)
    selected = select_units(model, units)
    # Made before the model changes, so that options torch.compile refuses leave the model as it was.
    forwards = [_unit_forward(module, activation_checkpointing, compile_options) for _, module in selected]
    owned = assign_params(model, [name for name, _ in selected])
    _check_wire_carries(wire, owned)
    _check_diloco_fragments(diloco, owned)
    layout = Layout.build(plan, wire, diloco, policy, process_group, device, deadline, fault_tolerance)
    comm = layout.world
    _check_same_schedule_on_all_ranks(comm, prefetch, reshard_after_forward)
    _check_same_model_on_all_ranks(owned, comm)

    make_unit = functools.partial(_build_unit, layout=layout, policy=policy, wire=wire)
    if on_meta:
        root, *block_units = materialize.build_units(model, selected, owned, device, init, comm, make_unit)
    else:
        for name, buffer in model.named_buffers():
            if comm.world > 1:
                comm.broadcast(buffer.data, tag=f"initial value of {name}").wait()
        root = make_unit(0, "", model, owned[""])
        block_units = [make_unit(i, name, module, owned[name]) for i, (name, module) in enumerate(selected, 1)]
    engine = Engine(
        root,
        block_units,
        layout=layout,
        prefetch=prefetch,
        reshard_after_forward=reshard_after_forward,
        input_dtype=policy.param_dtype if policy.cast_forward_inputs else None,
        state_dict_keys=state_dict_keys,
    )
    engine.install_hooks()
    sharded_state_dict.install(model, engine.flats)
    model.register_load_state_dict_post_hook(lambda module, incompatible: engine.weights_loaded())
    for unit, forward in zip(block_units, forwards):
        if forward is not None:
            unit.module.forward = forward
    setattr(model, _ENGINE_ATTR, engine)
    guards.watch()
    for module in model.modules():
        setattr(module, guards.SHARDED_ATTR, True)
    return model


def _flag(name: str, value, note: str = "") -> bool:
    """A yes or no argument: a bool, numpy's, or 0 or 1; not text ("no" is true to Python) or a count."""
    if isinstance(value, (bool, numpy.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {shown(value)}{note}")


def engine_of(model: nn.Module) -> Engine:
    """The engine driving a sharded model; a clear error for a model ``shard`` never saw."""
    engine = getattr(model, _ENGINE_ATTR, None)
    if engine is None:
        raise ValueError(f"{type(model).__name__} is not sharded: call shardwire.shard(model) first")
    return engine


def _check_not_sharded(model: nn.Module) -> None:
    if getattr(model, guards.SHARDED_ATTR, False) and not hasattr(model, _ENGINE_ATTR):
        raise ValueError(
            f"this {type(model).__name__} is part of a model that is already sharded; shard the whole "
            f"model once, choosing its units with units=..."
        )
    for name, module in model.named_modules():
        if hasattr(module, _ENGINE_ATTR):
            where = "this model" if module is model else f"its submodule {name!r}"
            raise ValueError(
                f"{where} is already sharded; shard a model once, choosing its units with units=..."
            )
    # A port from FSDP2 that kept a ``fully_shard`` call, or a model already split by tensor
    # parallelism: its parameters are DTensors over another mesh, which shard would slice again.
    # FSDP1 flattens the parameters of the modules it wraps into its own (``FlatParameter``), in
    # place: the wrapper, or the module inside it, trains otherwise without a word.
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            _refuse_sharded_by_torch("this model" if not name else f"its submodule {name!r}", _FULLY_SHARD)
        if isinstance(module, FullyShardedDataParallel):
            _refuse_sharded_by_torch("this model" if not name else f"its submodule {name!r}", _FSDP1)
    for name, param in model.named_parameters():
        if isinstance(param, FlatParameter):
            _refuse_sharded_by_torch(f"its parameter {name!r}", _FSDP1)
        if isinstance(param, DTensor):
            raise ValueError(f"parameter {name!r} is already a DTensor (tensor parallelism, or a model sharded "
                             f"before): shardwire.shard takes a model of plain tensors; build it without that, then "
                             f"shard it")


_FULLY_SHARD = "torch's fully_shard: remove the fully_shard calls"
_FSDP1 = ("torch's FullyShardedDataParallel (FSDP1), which flattened its parameters in place: build the model again "
          "without it")


def _refuse_sharded_by_torch(where: str, how: str) -> None:
    raise ValueError(f"{where} went through {how}, as shardwire.shard(model, units=...) shards the model and its units "
                     f"in one call")


def _single_device(model: nn.Module) -> torch.device:
    devices: dict[torch.device, list[str]] = {}
    for name, param in model.named_parameters():
        devices.setdefault(param.device, []).append(name)
    if not devices:
        raise ValueError(f"{type(model).__name__} has no parameters to shard")
    if len(devices) > 1:
        where = "; ".join(f"{device}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                          for device, names in devices.items())
        raise ValueError(
            f"parameters are on several devices ({where}); move the whole model to one device "
            f"(this rank's GPU, or the CPU) before sharding"
        )
    (device,) = devices
    return device


def _device(current: torch.device, device: torch.device | str | None, init: Callable | None,
            process_group: dist.ProcessGroup | None) -> torch.device:
    """The device the sharded model lives on: the model's (``current``), or for a model on the meta
    device the one it is made on."""
    if current.type == "meta":
        group = process_group if process_group is not None else dist.group.WORLD if dist.is_initialized() else None
        return materialize.target_device(device, None if group is None else str(dist.get_backend(group)))
    if init is not None:
        raise ValueError(f"init= initialises a model built on the meta device, but this model's parameters are "
                         f"on {current} and have their values: initialise them before sharding, or build the "
                         f"model under torch.device('meta')")
    if device is not None and materialize.as_device(device) != current:
        raise ValueError(f"device={shown(str(device))}, but the model's parameters are on {current}: device= is where "
                         f"a model built on the meta device is made; move a model with values before sharding it")
    return current


def _compile_options(spec: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``shard``'s ``compile`` as ``torch.compile``'s keyword arguments; None: run eagerly.

    ``fullgraph`` defaults to True: with the engine's hooks outside the compiled region, a unit's
    forward has nothing that must break its graph, and a break it does have (a ``print``, a
    data-dependent branch) is better an error at the first step than a quiet slowdown.
    """
    if spec is False:
        return None
    options = {} if spec is True else spec
    if not isinstance(options, Mapping):
        raise ValueError(
            f"compile={spec!r} is not understood: pass True, or a dict of torch.compile's keyword "
            f"arguments, e.g. {{'mode': 'max-autotune'}}"
        )
    accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"compile={dict(options)!r}: torch.compile takes no {', '.join(map(repr, unknown))}; "
            f"its keyword arguments are {', '.join(sorted(accepted))}"
        )
    return {"fullgraph": True, **options}


def _unit_forward(module: nn.Module, activation_checkpointing: bool,
                  compile_options: dict[str, Any] | None) -> Callable | None:
    """What a unit's module runs between the engine's hooks: its own ``forward``, checkpointed and
    compiled as asked (None where neither is).

    The wrappers replace ``module.forward`` rather than wrapping the module's call (as
    ``module.compile()`` or ``torch.compile(module)`` do), because the call runs the engine's hooks,
    whose gathers and agreement checks would break the graph on every unit. Inside them a unit's
    parameters are views of its gathered buffer, new tensors at every step: dynamo inlines
    ``nn.Module`` code (``inline_inbuilt_nn_modules``, the default since torch 2.5), so it takes them
    as graph inputs guarded by shape, dtype and strides, not by identity, and one compilation serves
    every step and every unit of the same class. Compiling outside the checkpoint, as torchtitan
    compiles its checkpointed blocks, traces the checkpoint into the graph, so backward's
    recomputation is compiled too.
    """
    if not activation_checkpointing and compile_options is None:
        return None
    forward = module.forward
    if activation_checkpointing:
        forward = functools.partial(checkpoint, forward, use_reentrant=False)
    if compile_options is not None:
        forward = torch.compile(forward, **compile_options)
    return forward


def _flat_groups(params: list[OwnedParam]) -> dict[tuple[torch.dtype, bool], list[OwnedParam]]:
    """Parameters grouped by (dtype, requires_grad): each group becomes one flat buffer."""
    grouped: dict[tuple[torch.dtype, bool], list[OwnedParam]] = {}
    for entry in params:
        grouped.setdefault((entry.param.dtype, entry.param.requires_grad), []).append(entry)
    return grouped


def _check_wire_carries(wire: Wire, owned: dict[str, list[OwnedParam]]) -> None:
    """Quantization is for floating-point values: refuse it for a model with other parameters."""
    if wire.params is None:
        return
    for entries in owned.values():
        for entry in entries:
            if not entry.param.is_floating_point():
                raise ValueError(
                    f"parameter {entry.names[0]!r} is {str(entry.param.dtype).removeprefix('torch.')}, which "
                    f"wire params={wire.params!r} cannot quantize: keep integer values as buffers "
                    f"(register_buffer), or leave params unquantized (wire='params=none,grads=...')"
                )


def _check_diloco_fragments(diloco: DiLoCo | None, owned: dict[str, list[OwnedParam]]) -> None:
    """Fragments are made of whole units with trainable parameters: refuse more fragments than those."""
    if diloco is None:
        return
    diloco.check_units(sum(any(entry.param.requires_grad for entry in entries) for entries in owned.values()))


def _build_unit(index, name, module, params, *, layout, policy, wire, values=None) -> Unit:
    """Make a unit of ``params``: from rank 0's values, or, given ``values`` (by the id of each
    parameter; the same on every rank), from those without sending any."""
    name = name or "<root>"
    grouped = _flat_groups(params)
    comm = layout.world
    flats = []
    for (dtype, requires_grad), entries in grouped.items():
        packing = Packing.pack([(e.names, tuple(e.param.shape)) for e in entries], dtype, layout.shard.world)
        if values is None:
            full = packing.flatten([e.param.detach() for e in entries])
            if comm.world > 1:
                comm.broadcast(full, tag=f"initial values of {name}").wait()
            start, end = packing.shard_range(layout.shard.rank)
            shard = full[start:end].clone()
        else:
            shard = packing.shard_of([values[id(e.param)].detach() for e in entries], layout.shard.rank)
        suffix = f"flat_shard_{str(dtype).removeprefix('torch.')}" + ("" if requires_grad else "_frozen")
        flat = FlatParam(
            f"{name}.{suffix}" if len(grouped) > 1 else name,
            packing,
            shard,
            [e.owners for e in entries],
            requires_grad=requires_grad,
            compute_dtype=policy.param_dtype or dtype,
            reduce_dtype=policy.reduce_dtype or policy.param_dtype or dtype,
            layout=layout,
            wire=wire,
        )
        for entry, param in zip(entries, flat.params):
            for owner, param_name in entry.owners:
                owner._parameters[param_name] = param
            guards.carry_attributes(entry.param, param)
            if values is not None:  # a meta build: and what its initialisation set on a parameter it assigned anew
                guards.carry_attributes(values[id(entry.param)], param)
            setattr(entry.param, guards.REPLACED_ATTR, True)
        flats.append(flat)
    return Unit(index, name, module, flats)


def _check_same_schedule_on_all_ranks(comm: Communicator, prefetch: int, reshard_after_forward: bool) -> None:
    """``prefetch`` and ``reshard_after_forward`` set the order of every rank's gathers: ranks that
    differ would meet in different collectives at the first step. Compare them here, and say who
    asked for what."""
    if comm.world == 1:
        return
    rows = comm.all_gather_values([prefetch, int(reshard_after_forward)], tag="schedule check")
    if any(row != rows[0] for row in rows):
        asked = "; ".join(f"rank {r}: prefetch={ahead}, reshard_after_forward={bool(reshard)}"
                          for r, (ahead, reshard) in enumerate(rows))
        raise ValueError(f"ranks asked for different schedules ({cut(asked, 300)}): pass the same prefetch and "
                         f"reshard_after_forward on every rank")


def _check_same_model_on_all_ranks(owned, comm: Communicator) -> None:
    """Every rank must shard the same model: compare a fingerprint of each unit's parameters."""
    if comm.world == 1:
        return
    names = list(owned)
    prints = [
        zlib.crc32(repr([(e.names, tuple(e.param.shape), str(e.param.dtype)) for e in owned[n]]).encode())
        for n in names
    ]
    for what, values in (("unit count", [len(names)]), ("parameters", prints)):
        rows = comm.all_gather_values(values, tag=f"model check ({what})")
        for r, row in enumerate(rows):
            if row != rows[0]:
                if what == "unit count":
                    raise ValueError(
                        f"rank 0's model has {rows[0][0] - 1} units and rank {r}'s has {row[0] - 1}: pass the same "
                        f"units on every rank, and build the same model (same config, same code) before sharding")
                i = next(i for i, (a, b) in enumerate(zip(rows[0], row)) if a != b)
                raise ValueError(
                    f"rank {r}'s model differs from rank 0's: unit {names[i] or '<root>'!r} has different parameter "
                    f"names or shapes. Every rank must build the same model (same config, same code) before sharding"
                )
