"""A model built on the meta device, made a unit at a time: no rank ever holds it whole.

A model built under ``torch.device("meta")`` has every parameter's shape and dtype and no storage.
``shard`` walks its modules children first, as ``model.apply(init)`` does; it gives each module's
own parameters and buffers storage on the device, uninitialised (as ``to_empty`` does), and runs
the initialisation on it. The moment a unit's subtree is done, the unit is cut into this rank's
shard and its whole parameters are dropped. So a rank's peak beyond its shards is one unit's
parameters, plus the root unit's, which are done last.

The initialisation draws in the order the whole model's would (``model.to_empty(device=...)``,
then ``model.apply(init)``) and from the same generator: rank 0's, of which every rank draws from a
copy. So every rank computes the same values and no value is sent, and they are bit-equal to that
whole model's. Rank 0's own generator advances as if it had initialised the whole model and the
others' stay as they were, as after sharding a model built on every rank (whose rank 0 values are
broadcast).

What initialises a module: ``shard``'s ``init`` (any ``fn(module)``, as for ``model.apply``); by
default a Hugging Face model's own (``_init_weights``, run as its ``initialize_weights`` runs it,
rotary frequencies included), and otherwise each module's ``reset_parameters()``, the convention of
torch's layers (and FSDP1's default for meta-device modules).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardwire.comm.communicator import Communicator
from shardwire.engine.released import ReleasedError
from shardwire.engine.selection import OwnedParam
from shardwire.engine.unit import Unit

Init = Callable[[nn.Module], None]
# Builds a unit from its index, name, module and parameters, taking their values (by the id of the
# meta parameter) from ``values``.
MakeUnit = Callable[..., Unit]


def target_device(device: torch.device | str | None, group_backend: str | None) -> torch.device:
    """Where a meta model's parts are made: ``device``, or by default the current CUDA device under
    NCCL (or with no process group yet where CUDA is available) and the CPU otherwise."""
    if device is not None:
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("device='meta' has no storage to make the model's parts in: pass the device "
                             "to train on, e.g. device='cuda' or device='cpu'")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    wants_cuda = "nccl" in group_backend if group_backend is not None else torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if wants_cuda else torch.device("cpu")


def build_units(model: nn.Module, units: list[tuple[str, nn.Module]], owned: dict[str, list[OwnedParam]],
                device: torch.device, init: Init | None, comm: Communicator, make_unit: MakeUnit) -> list[Unit]:
    """Make the units of the meta model ``model`` on ``device``, each as soon as its modules are
    initialised (the root last); returns the root unit, then those of ``units``, in order."""
    index = {id(module): (i, name) for i, (name, module) in enumerate(units, 1)}
    made: dict[int, nn.Parameter] = {}  # by the id of the meta parameter: a tied one is made once
    buffers: list[tuple[nn.Module, str]] = []
    built: dict[int, Unit] = {}
    walk = _initialiser(model, init)

    def visit(module: nn.Module, name: str, walk: _Walk) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, walk.below(child))
        _give_storage(module, device, made, buffers)
        try:
            walk(module)
        except ReleasedError as error:
            raise ValueError(
                f"the initialisation of {name or 'the model'} ({type(module).__name__}) writes a parameter of "
                f"{error.unit_name!r}, a unit already made: on the meta device each module must initialise "
                f"only its own parameters and those of modules inside it (children come first, as "
                f"model.apply(init) runs them). Move that write into the module that owns the parameter"
            ) from None
        if id(module) in index:
            i, unit_name = index[id(module)]
            built[i] = make_unit(i, unit_name, module, owned[unit_name], values=made)
            for entry in owned[unit_name]:
                made.pop(id(entry.param))

    with _generator_of_rank0(comm, device), torch.no_grad(), walk.context():
        visit(model, "", walk)
    built[0] = make_unit(0, "", model, owned[""], values=made)
    _check_buffers_set(model, buffers)
    return [built[i] for i in range(len(units) + 1)]


def _give_storage(module: nn.Module, device: torch.device, made: dict[int, nn.Parameter],
                  buffers: list[tuple[nn.Module, str]]) -> None:
    """Give the module's own meta parameters and buffers uninitialised storage on ``device``; floating
    buffers are filled with NaN, so that one the initialisation never sets is found."""
    for name, param in module._parameters.items():
        if param is not None and param.is_meta:
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty_like(param, device=device),
                                               requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[name] = torch.empty_like(buffer, device=device)
            if buffer.is_floating_point():
                module._buffers[name].fill_(float("nan"))
                buffers.append((module, name))


def _check_buffers_set(model: nn.Module, buffers: list[tuple[nn.Module, str]]) -> None:
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    unset = [f"{names[id(module)]}.{name}".lstrip(".") for module, name in buffers
             if torch.isnan(module._buffers[name]).any()]
    if unset:
        raise ValueError(
            f"buffer(s) {', '.join(map(repr, unset[:3]))}{' ...' if len(unset) > 3 else ''} were left unset: "
            f"a model built on the meta device has no values for buffers computed in __init__ (causal masks, "
            f"rotary frequencies), and the initialisation did not set them. Set them in the module's "
            f"reset_parameters, or pass shard(init=fn) with an fn that does"
        )


@contextlib.contextmanager
def _generator_of_rank0(comm: Communicator, device: torch.device) -> Iterator[None]:
    """Draw from rank 0's default generator (the CPU's, and ``device``'s where it is a GPU) on every
    rank; leave the other ranks' own generators as they were."""
    if comm.world == 1:
        yield
        return
    cuda = device.type == "cuda"
    states = [torch.get_rng_state(), *([torch.cuda.get_rng_state(device)] if cuda else [])]
    shared = [state.to(comm.device) for state in states]
    for state in shared:
        comm.broadcast(state, tag="the random generator's state for the meta model").wait()
    if comm.rank == 0:
        yield
        return
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.set_rng_state(shared[0].cpu())
        if cuda:
            torch.cuda.set_rng_state(shared[1].cpu(), device)
        yield


class _Walk:
    """Initialises one module, and says what initialises the modules below a child."""

    def __init__(self, init: Init):
        self._init = init

    def __call__(self, module: nn.Module) -> None:
        self._init(module)

    def below(self, child: nn.Module) -> _Walk:
        return self

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _HuggingFaceWalk(_Walk):
    """A Hugging Face model's own initialisation, as its ``initialize_weights`` runs it: each module by
    the ``_initialize_weights`` of the nearest model that contains it (a composite model's sub-models
    initialise their own modules), inside the guard that keeps torch's init functions from touching
    what is marked initialised."""

    def __init__(self, model: nn.Module, custom_code: bool):
        self._model = model
        self._custom_code = custom_code
        initialize = model._initialize_weights
        if "is_custom_code" in inspect.signature(initialize).parameters:
            initialize = functools.partial(initialize, is_custom_code=custom_code)
        super().__init__(initialize)

    def below(self, child: nn.Module) -> _Walk:
        return _HuggingFaceWalk(child, self._custom_code) if _is_pretrained(child) else self

    def context(self) -> contextlib.AbstractContextManager:
        guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
        return guard() if guard is not None else contextlib.nullcontext()


def _initialiser(model: nn.Module, init: Init | None) -> _Walk:
    if init is not None:
        if not callable(init):
            raise TypeError(f"init must be a function of one module, as for model.apply, got {init!r}")
        return _Walk(init)
    if _is_pretrained(model):
        custom = model.is_custom_code() if hasattr(model, "is_custom_code") else False
        return _HuggingFaceWalk(model, custom)
    return _Walk(_reset_parameters)


def _reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _is_pretrained(module: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)
