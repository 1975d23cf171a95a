"""Mistakes made around a sharded model that no collective sees, refused before they train wrong.

``shard`` replaces each parameter by a DTensor of its unit's shard, and the engine runs the units it
found then. Two mistakes leave a script that runs on and trains wrong, silently:

* an optimizer built from ``model.parameters()`` before ``shard`` holds the parameters as they were,
  which the model no longer trains: its ``step()`` never changes the model; so does one given a
  module's attribute (``model.head.weight``, a placeholder between uses: ``released``);
* a module added to a sharded model afterwards (a block replaced, an adapter added, by assignment or
  ``ModuleList.insert``) keeps plain parameters the engine never gathers or reduces: each rank trains
  its own copy, and the ranks drift.

A third would come from the replacement itself: a mark the user set on a parameter (a no-decay
flag), which an optimizer-group builder reads, missing from its DTensor; ``carry_attributes``
carries it over.

An optimizer is checked at each step through torch's process-wide step hook, which ``watch``
installs once and which looks only at the parameters ``shard`` marked as replaced (a pass over the
optimizer's parameters, a tenth of a millisecond for a thousand). The model is checked at each
forward (``refuse_unsharded_parameters``), where no way of adding a module escapes it.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardwire.engine.released import ReleasedParameter

# Set on every module of a sharded model: its parameters are no longer its own to shard again.
SHARDED_ATTR = "_shardwire_sharded"
# Set on a parameter that ``shard`` replaced: the model no longer holds it.
REPLACED_ATTR = "_shardwire_replaced"


def carry_attributes(old: nn.Parameter, new: nn.Parameter) -> None:
    """Give ``new``, which replaces ``old`` in the model, what the user set on ``old``
    (``_no_weight_decay``, muP's ``infshape``): optimizer-group builders read it, and DDP keeps the
    parameter itself. Not torch's hooks, which expect ``old``'s gradient."""
    new.__dict__.update({key: value for key, value in vars(old).items() if key not in _NOT_CARRIED})


# A parameter's attributes that belong to it alone: torch's hooks, and the mark of its replacement.
_NOT_CARRIED = frozenset({"_backward_hooks", "_post_accumulate_grad_hooks", REPLACED_ATTR})


@functools.cache
def watch() -> None:
    """Install the optimizers' hook, once per process."""
    register_optimizer_step_pre_hook(_refuse_replaced_parameters)


def _refuse_replaced_parameters(optimizer, args, kwargs) -> None:
    params = [param for group in optimizer.param_groups for param in group["params"]]
    stale = sum(getattr(param, REPLACED_ATTR, False) for param in params)
    if stale:
        raise ValueError(
            f"this {type(optimizer).__name__} holds {stale} parameter(s) that shardwire.shard replaced in its model, "
            f"which trains its own (model.parameters()): its step would never change the model. Build the "
            f"optimizer from model.parameters() after shardwire.shard(model)"
        )
    released = [param.param_name for param in params if isinstance(param, ReleasedParameter)]
    if released:
        raise ValueError(
            f"this {type(optimizer).__name__} holds {', '.join(map(repr, released[:3]))}"
            f"{' ...' if len(released) > 3 else ''} as read from a module's attribute of a sharded model: a "
            f"placeholder between forwards, not the parameter the model trains, so its step would never change the "
            f"model. Build the optimizer's groups from model.named_parameters() (by name)"
        )


def refuse_unsharded_parameters(model: nn.Module) -> None:
    """Refuse parameters of ``model`` that ``shard`` never saw, added with a module after it."""
    plain = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if plain:
        raise RuntimeError(
            f"parameter(s) {', '.join(map(repr, plain[:3]))}{' ...' if len(plain) > 3 else ''} of this sharded "
            f"{type(model).__name__} came with a module added after shardwire.shard: they would be neither gathered "
            f"nor reduced, and each rank would train its own copy. Replace or add modules before sharding the model"
        )
