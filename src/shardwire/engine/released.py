"""What a module's parameter attribute holds while its unit is released.

Between uses, a sharded unit's full parameters do not exist on this rank. The module attribute must
then still answer questions about the parameter (shape, dtype: ``repr(model)``, shape checks) but
refuse to compute: a view of the released storage would read freed memory, and a plain meta tensor
quietly turns ``F.linear(cpu_input, meta_weight)`` into a CPU tensor of garbage.
"""

from __future__ import annotations

import torch

_T = torch.Tensor
_METADATA = {
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.layout.__get__,
    _T.requires_grad.__get__, _T.is_leaf.__get__, _T.grad.__get__,
    _T.size, _T.dim, _T.numel, _T.__repr__, _T.__format__,
}


class ReleasedError(RuntimeError):
    """A computation with a parameter whose unit is not gathered."""

    def __init__(self, message: str, unit_name: str):
        super().__init__(message)
        self.unit_name = unit_name


class ReleasedParameter(torch.Tensor):
    """Shape and dtype of a parameter whose unit is not gathered; any computation raises."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, name: str, unit: str):
        placeholder = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        placeholder.param_name = name
        placeholder.unit_name = unit
        return placeholder

    def __deepcopy__(self, memo):
        refuse_copy(self.unit_name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        released = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ReleasedParameter))
        raise ReleasedError(
            f"{released.param_name!r} belongs to sharded unit {released.unit_name!r}, which is not "
            f"gathered now: a sharded model's whole weights exist only while their unit runs inside the "
            f"model's forward or backward, as calling the model runs them (model(x); model.forward(x) runs no "
            f"hooks to gather them). This rank's part of it is in model.named_parameters(); read "
            f"whole weights with shardwire.full_state_dict(model); change the model's shapes "
            f"(resize_token_embeddings) before shardwire.shard; initialise its weights (init_weights) through "
            f"shardwire.shard(model, init=...) on a model built on the meta device, or load them with "
            f"model.load_state_dict.",
            released.unit_name,
        )


def refuse_copy(unit_name: str) -> None:
    """Refuse ``copy.deepcopy`` of a sharded model or of a module of one (reaching its engine or a
    placeholder): the copy would hold shards and share the original's buffers and process groups."""
    raise ReleasedError(
        "a sharded model cannot be copied (copy.deepcopy): its parameters exist only as this rank's shards, and "
        "the copy would share the original's buffers and process groups. Copy the model before shardwire.shard "
        "and shard the copy too, or copy what you need of model.parameters()",
        unit_name,
    )
