"""Mistakes made around a sharded model that no collective sees, refused where they are made.

``shard`` replaces each parameter by a DTensor of its unit's shard, and the engine runs the units it
found then. Two mistakes leave a script that runs on and trains wrong, silently:

* an optimizer built from ``model.parameters()`` before ``shard`` holds the parameters as they were,
  which no gradient reaches any more: its ``step()`` changes nothing, every step;
* a module assigned into a sharded model afterwards (a block replaced, an adapter added) keeps plain
  parameters the engine never gathers or reduces: each rank trains its own copy, and the ranks drift.

Both go through torch's process-wide hooks (an optimizer's step, a module's registration), which
``watch`` installs once; each hook looks only at what ``shard`` marked, so other models and
optimizers in the process are untouched. An optimizer is checked at its first step, and again only
when it gains param groups.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_module_registration_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Set on every module of a sharded model: its parameters are no longer its own to shard again.
SHARDED_ATTR = "_shardwire_sharded"
# Set on a parameter that ``shard`` replaced: the model no longer holds it.
REPLACED_ATTR = "_shardwire_replaced"
# Set on an optimizer once checked: how many of its param groups were.
_CHECKED_ATTR = "_shardwire_checked_groups"


@functools.cache
def watch() -> None:
    """Install the hooks, once per process."""
    register_optimizer_step_pre_hook(_refuse_replaced_parameters)
    register_module_module_registration_hook(_refuse_unsharded_module)


def _refuse_replaced_parameters(optimizer, args, kwargs) -> None:
    groups = optimizer.param_groups
    if getattr(optimizer, _CHECKED_ATTR, None) == len(groups):
        return
    stale = sum(getattr(param, REPLACED_ATTR, False) for group in groups for param in group["params"])
    if stale:
        raise ValueError(
            f"this {type(optimizer).__name__} holds {stale} parameter(s) of a model as it was before "
            f"shardwire.shard replaced them, which no gradient reaches: its step would change nothing. Build "
            f"the optimizer from model.parameters() after shardwire.shard(model)"
        )
    setattr(optimizer, _CHECKED_ATTR, len(groups))


def _refuse_unsharded_module(module: nn.Module, name: str, submodule: nn.Module) -> None:
    if not getattr(module, SHARDED_ATTR, False):
        return
    plain = [param_name for param_name, param in submodule.named_parameters() if not isinstance(param, DTensor)]
    if plain:
        raise ValueError(
            f"module {name!r} ({type(submodule).__name__}), assigned into a sharded {type(module).__name__}, "
            f"has parameters shardwire.shard never saw ({', '.join(map(repr, plain[:3]))}"
            f"{' ...' if len(plain) > 3 else ''}): they would be neither gathered nor reduced, and each rank "
            f"would train its own copy. Replace or add modules before sharding the model"
        )
