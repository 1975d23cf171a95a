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
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardwire.comm.communicator import Communicator
from shardwire.engine import guards
from shardwire.engine.released import ReleasedError
from shardwire.engine.selection import OwnedParam
from shardwire.engine.unit import Unit
from shardwire.mappings import shown

Init = Callable[[nn.Module], None]
# Builds a unit from its index, name, module and parameters, taking their values (by the id of the
# meta parameter) from ``values``.
MakeUnit = Callable[..., Unit]


def as_device(device: torch.device | str | int) -> torch.device:
    """``shard``'s ``device=`` as a ``torch.device``, or a one-line error naming it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={shown(device)} is not a device: pass e.g. 'cuda', 'cuda:1' or 'cpu'") from None


def target_device(device: torch.device | str | None, group_backend: str | None) -> torch.device:
    """Where a meta model's parts are made: ``device``, or by default the current CUDA device under
    NCCL (or with no process group yet where CUDA is available) and the CPU otherwise."""
    if device is not None:
        device = as_device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={shown(str(device))}, but torch sees no CUDA device here: make the model on "
                             f"'cpu', or run where a GPU is")
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
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    storage = _Storage(device)
    built: dict[int, Unit] = {}
    walk = _initialiser(model, init)

    def visit(module: nn.Module, name: str, walk: _Walk) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, walk.below(child))
        storage.give(module)
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
            storage.take(owned[unit_name], names)
            built[i] = make_unit(i, unit_name, module, owned[unit_name], values=storage.params)
            for entry in owned[unit_name]:
                storage.params.pop(id(entry.param))

    with _generator_of_rank0(comm, device), torch.no_grad(), walk.context():
        visit(model, "", walk)
    storage.take(owned[""], names)
    built[0] = make_unit(0, "", model, owned[""], values=storage.params)
    storage.check_buffers(names)
    return [built[i] for i in range(len(units) + 1)]


class _Storage:
    """Storage for a meta model's parameters and buffers, and whether the initialisation wrote it.

    Storage comes uninitialised, so a value nothing initialises would train as whatever memory held:
    a parameter of a module without ``reset_parameters``, an integer buffer computed in ``__init__``
    (positions, indices). So it is filled with a mark: NaN, where any element left so is unset (a
    write of some rows is not enough), and for bools the byte 2, which no bool operation writes. An
    integer tensor is unset where some elements still hold the largest integer and others not (a
    write of some rows; 32 and 64 bits only, whose largest integer no table holds), or where it
    holds it everywhere and nothing wrote it since (torch's version
    counter, its data): a write of the largest integer everywhere counts, and the mark is in the
    values, so a write through ``.data``, which no version counter of the tensor's sees, counts as
    one everywhere else.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.params: dict[int, nn.Parameter] = {}  # by the id of the meta parameter: a tied one is made once
        self._buffers: list[tuple[nn.Module, str]] = []
        # by the id of each integer tensor given: the tensor (weakly: a unit's are freed once it is made),
        # its data and its version counter then
        self._given: dict[int, tuple[weakref.ref, int, int]] = {}

    def give(self, module: nn.Module) -> None:
        """Give the module's own meta parameters and buffers marked storage."""
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in self.params:
                    made = nn.Parameter(self._marked_like(param), requires_grad=param.requires_grad)
                    guards.carry_attributes(param, made)
                    self.params[id(param)] = self._remember(made)
                module._parameters[name] = self.params[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = self._remember(self._marked_like(buffer))
                self._buffers.append((module, name))

    def take(self, entries: list[OwnedParam], names: dict[int, str]) -> None:
        """Take the values of a unit's parameters as the initialisation left them, each where any of
        its owners holds it: the storage given, or a parameter it assigned anew (``module.weight =
        nn.Parameter(...)``, by the module or a parent, by either owner of a tied one), moved to the
        device; refuse any left unset. ``names``: each module's name, by its id."""
        unset = []
        for entry in entries:
            given = self.params[id(entry.param)]
            for owner, attr in entry.owners:
                now = owner._parameters.get(attr)
                if now is not given:
                    self.params[id(entry.param)] = self._assigned(now, given, names[id(owner)], owner, attr)
                    break
            if self._unset(self.params[id(entry.param)]):
                unset.append(entry.names[0])
        _refuse_unset("parameter", unset, "weights that no reset_parameters sets (a gain, a scale)")

    def check_buffers(self, names: dict[int, str]) -> None:
        unset = [f"{names[id(module)]}.{name}".lstrip(".") for module, name in self._buffers
                 if self._unset(module._buffers[name])]
        _refuse_unset("buffer", unset, "buffers computed in __init__ (causal masks, rotary frequencies, positions)")

    def _assigned(self, now, given: nn.Parameter, where: str, owner: nn.Module, attr: str) -> nn.Parameter:
        """The parameter the initialisation assigned in place of ``given``, on the device."""
        if not isinstance(now, torch.Tensor) or now.shape != given.shape or now.dtype != given.dtype or now.is_meta:
            change = "removed it" if now is None else (
                f"replaced it by a {'x'.join(map(str, now.shape)) or 'scalar'} {now.dtype}"
                f"{' on the meta device' if now.is_meta else ''}"
                if isinstance(now, torch.Tensor) else f"replaced it by a {type(now).__name__}")
            raise ValueError(
                f"the initialisation of {where or 'the model'} ({type(owner).__name__}) {change}, where the model "
                f"built it as a {'x'.join(map(str, given.shape)) or 'scalar'} {given.dtype} parameter {attr!r}: "
                f"initialise parameters in place (nn.init, copy_), with the shape and dtype they were built with")
        if now.requires_grad != given.requires_grad:  # the unit's buffers are laid out by the flag it was built with
            raise ValueError(
                f"the initialisation of {where or 'the model'} ({type(owner).__name__}) assigned {attr!r} with "
                f"requires_grad={now.requires_grad}, where the model was built with {given.requires_grad} (or frozen "
                f"before shard): assign it with requires_grad={given.requires_grad}, or initialise it in place")
        if now.device != self.device:
            moved = nn.Parameter(now.detach().to(self.device), requires_grad=now.requires_grad)
            guards.carry_attributes(now, moved)
            return moved
        return now

    def _marked_like(self, meta: torch.Tensor) -> torch.Tensor:
        tensor = torch.empty_like(meta, device=self.device)
        if tensor.dtype == torch.bool:
            tensor.view(torch.uint8).fill_(_BOOL_MARK)
        else:  # in place: a model's largest table is no copy
            tensor.fill_(float("nan") if _marked_by_nan(tensor) else torch.iinfo(tensor.dtype).max)
        return tensor

    def _remember(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (_marked_by_nan(tensor) or tensor.dtype == torch.bool):
            self._given[id(tensor)] = (weakref.ref(tensor), tensor.data_ptr(), tensor._version)
        return tensor

    def _unset(self, tensor: torch.Tensor) -> bool:
        if _marked_by_nan(tensor):
            return bool(torch.isnan(tensor).any())
        if tensor.dtype == torch.bool:
            return bool((tensor.view(torch.uint8) == _BOOL_MARK).any())
        marked = tensor == torch.iinfo(tensor.dtype).max
        if not marked.all():  # 255 or 32767 are a small integer table's own values; 2^31 - 1 and up are not
            return tensor.element_size() >= 4 and bool(marked.any())
        given, data, version = self._given.get(id(tensor), (None, None, None))
        untouched = given is not None and given() is tensor and (tensor.data_ptr(), tensor._version) == (data, version)
        return untouched and tensor.numel() > 0


# A bool's byte is 0 or 1: no bool operation writes this.
_BOOL_MARK = 2


def _marked_by_nan(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _refuse_unset(kind: str, unset: list[str], examples: str) -> None:
    if unset:
        raise ValueError(
            f"{kind}(s) {', '.join(map(repr, unset[:3]))}{' ...' if len(unset) > 3 else ''} were left unset: a "
            f"model built on the meta device has no values for {examples} until its initialisation writes "
            f"them, and it did not. Set them in the module's reset_parameters, or pass shard(init=fn) with an "
            f"fn that does"
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
