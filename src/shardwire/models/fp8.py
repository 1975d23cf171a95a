"""fp8 matrix multiplies in training: torchao's float8 training, applied to the linear layers of units.

fp8 training is torchao's, as torchtitan runs it with FSDP2: each converted ``nn.Linear`` becomes a
``Float8Linear``, which casts its input, its weight and its output's gradient to fp8 with dynamic
per-tensor scales and multiplies on the fp8 tensor cores (Hopper and later), accumulating in higher
precision. Its weight stays an ordinary parameter in the model's dtype, so ``shard`` packs, gathers
and reduces it like any other; the units then compute in bf16 around their fp8 multiplies
(``shardwire train --precision fp8``).

Only linear layers inside units convert, and only those whose two dimensions are multiples of 16
(the shapes fp8 tensor cores take): the root's head stays in bf16, as torchtitan leaves its output
layer, since the logits' precision matters most and the head is one layer of many.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwire import worker
from shardwire.extras import MissingExtra, quietly_importing, require

# fp8 tensor cores multiply matrices whose dimensions are multiples of 16.
MULTIPLE = 16
# fp8 tensor cores came with Ada and Hopper: compute capability 8.9.
CAPABILITY = (8, 9)


def unavailable(backend: str) -> str | None:
    """Why fp8 training cannot run with ``backend`` on this machine, or None: torchao is missing, or
    a visible GPU has no fp8 tensor cores (on the CPU torch multiplies fp8 in software, slowly)."""
    try:
        _float8()
    except MissingExtra as err:
        return str(err)
    if worker.uses_cuda(backend):
        for index in range(torch.cuda.device_count()):
            if torch.cuda.get_device_capability(index) < CAPABILITY:
                return (f"--precision fp8 needs GPUs with fp8 tensor cores (compute capability "
                        f"{'.'.join(map(str, CAPABILITY))}: Ada, Hopper or later), and "
                        f"{torch.cuda.get_device_name(index)} has none: use --precision bf16")
    return None


def convert(model: nn.Module, units: Sequence[type[nn.Module]], **float8_options: Any) -> int:
    """Make the linear layers inside ``model``'s modules of the classes ``units`` multiply in fp8;
    ``float8_options`` are torchao's ``Float8LinearConfig`` fields (FSDP2 runs take
    ``enable_fsdp_float8_all_gather``). By default the third dimension of a multiply, the tokens of a
    weight's gradient, is padded where it is not a multiple of 16 (``pad_inner_dim``), so any batch
    and sequence length run. Returns how many layers converted; raises ``ValueError`` where none can,
    since an fp8 run that multiplies nothing in fp8 would only be slower."""
    float8 = _float8()
    chosen, refusal = convertible(model, units)
    if refusal is not None:
        raise ValueError(refusal)
    config = float8.Float8LinearConfig(**{"pad_inner_dim": True, **float8_options})
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in chosen)
    return len(chosen)


def convertible(model: nn.Module, units: Sequence[type[nn.Module]]) -> tuple[set[str], str | None]:
    """The names of the linear layers inside ``model``'s units that fp8 can multiply, and, where
    there are none, why (``model`` may be on the meta device: only its structure is read)."""
    inside_units = {f"{name}.{child}" for name, module in model.named_modules() if isinstance(module, tuple(units))
                    for child, _ in module.named_modules() if child}
    linear = {name: module for name, module in model.named_modules()
              if name in inside_units and type(module) is nn.Linear}
    chosen = {name for name, module in linear.items()
              if module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0}
    names = ", ".join(unit.__name__ for unit in units)
    if not linear:
        return chosen, (f"the units ({names}) hold no nn.Linear layer, the only kind torchao's fp8 training "
                        f"converts: train in bf16")
    if not chosen:
        return chosen, (f"no linear layer inside the units ({names}) has both dimensions multiples of "
                        f"{MULTIPLE}, which fp8 multiplies need: train in bf16")
    return chosen, None


def _float8():
    """torchao's float8 training, imported quietly."""
    with quietly_importing():
        return require("torchao.float8", "--precision fp8")
