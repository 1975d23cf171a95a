"""Choosing the sharding units of a model, and which unit owns each parameter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from torch import nn

UnitSpec = Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None


def select_units(model: nn.Module, units: UnitSpec) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs that become units, in module order.

    ``units=None`` picks the repeated blocks: the children of every ``nn.ModuleList`` that is not
    itself inside another picked block (a model without a ModuleList is then one root unit).
    Otherwise ``units`` is a list of module classes or a predicate ``fn(module) -> bool``; it must
    select at least one module, must not select the model itself, and must not select a module inside
    another selected one (units are gathered as a whole, so they cannot nest).
    """
    if units is None:
        return _default_units(model)
    predicate = _as_predicate(units)
    selected = [(name, module) for name, module in model.named_modules() if predicate(module)]
    if any(module is model for _, module in selected):
        raise ValueError(
            "units selects the model itself; the root unit is implicit (everything outside the "
            "units): select its blocks instead, e.g. units=[Block]"
        )
    if not selected:
        raise ValueError(
            f"units={units!r} selects no module of {type(model).__name__}: pass the classes of its "
            f"blocks (e.g. units=[Block]) or a predicate that returns True for them"
        )
    names = [name for name, _ in selected]
    for name in names:
        outer = next((other for other in names if name.startswith(other + ".")), None)
        if outer is not None:
            raise ValueError(
                f"units nest: {name!r} lies inside {outer!r}. Units are gathered whole, so they "
                f"cannot contain one another: select only the outer or only the inner modules"
            )
    return selected


def _as_predicate(units) -> Callable[[nn.Module], bool]:
    if isinstance(units, (list, tuple)):
        if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in units):
            raise TypeError(f"units must be a list of nn.Module classes or a predicate, got {units!r}")
        classes = tuple(units)
        return lambda module: isinstance(module, classes)
    if callable(units) and not isinstance(units, type):
        return units
    raise TypeError(f"units must be a list of nn.Module classes or a predicate, got {units!r}")


def _default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    selected: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(s + ".") for s, _ in selected):
            selected.extend((f"{name}.{child_name}", child) for child_name, child in module.named_children())
    return selected


@dataclasses.dataclass
class OwnedParam:
    """A parameter and every place the model exposes it: a tied parameter has several names."""

    param: nn.Parameter
    names: list[str]
    owners: list[tuple[nn.Module, str]]


def assign_params(
    model: nn.Module, unit_names: list[str]
) -> dict[str, list[OwnedParam]]:
    """Map each unit name ('' for the root) to the parameters it owns, in model order.

    A parameter belongs to the unit whose subtree holds it; one reachable from several units (say an
    embedding tied to an output head in another unit) belongs to the root, which is gathered for the
    whole step, so it is stored once and every user sees the same gathered copy.
    """
    by_id: dict[int, OwnedParam] = {}
    homes: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        home = next((u for u in unit_names if name.startswith(u + ".")), "")
        entry = by_id.setdefault(id(param), OwnedParam(param, [], []))
        entry.names.append(name)
        entry.owners.append((model.get_submodule(module_name), attr))
        homes.setdefault(id(param), set()).add(home)
    owned: dict[str, list[OwnedParam]] = {name: [] for name in ["", *unit_names]}
    for key, entry in by_id.items():
        unit_homes = homes[key]
        owned[unit_homes.pop() if len(unit_homes) == 1 else ""].append(entry)
    return owned


# torch's checkpoint_wrapper holds the module it wraps under this attribute, and its state dict hooks
# leave it out of the keys (as DCP's keys do): the keys a user's state dicts hold.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def state_dict_key(name: str) -> str:
    """The key the unsharded model's ``state_dict()`` gives the parameter or buffer ``name``."""
    return name.replace(CHECKPOINT_WRAPPED, "")


def state_dict_names(model: nn.Module) -> list[str]:
    """The unsharded ``model``'s state dict as names of its parameters and buffers
    (``named_parameters``, ``named_buffers``), in its order: the engine, its checkpoints and exports
    hold names, and ``state_dict_key`` gives the keys of the state dicts a user gives and takes."""
    names: dict[int, list[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    return [names[id(tensor)].pop(0) if names.get(id(tensor)) else key
            for key, tensor in model.state_dict(keep_vars=True).items()]
