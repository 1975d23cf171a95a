"""The mixed-precision policy: which dtype units compute in, and which dtype gradients are reduced in."""

from __future__ import annotations

import dataclasses

import torch

from shardwire.mappings import shown

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
# What a policy's dtypes may be (None: the parameters' own), in an order every rank knows, so that
# ranks can compare their policies as positions in it and name each other's (shardwire.engine.layout).
DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``; reduce-scatter gradients in ``reduce_dtype``.

    The master shards the optimizer updates always stay in the parameters' own dtype (fp32 for a
    model built in fp32): only the gathered copies are cast, so the all-gathers move half the bytes
    and the optimizer never loses precision. ``None`` for either field means "the parameter's own
    dtype". Reducing in fp32 while computing in bf16 is the usual choice: a sum over many ranks in
    bf16 loses bits that matter.

    With ``cast_forward_inputs`` (the default, as in FSDP2) floating-point tensors passed to the
    model's forward are cast to ``param_dtype``, so a model fed fp32 features computes in bf16 like
    one fed token ids. fp16 needs loss scaling: see ``shardwire.GradScaler``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field, use in (("param_dtype", "compute"), ("reduce_dtype", "reduce gradients")):
            dtype = getattr(self, field)
            if dtype not in DTYPES:
                raise ValueError(
                    f"MixedPrecision({field}={dtype}) is not a dtype units can {use} in: use one of "
                    f"{', '.join(map(str, DTYPES[1:]))}, or None for the parameters' own dtype"
                )

    @classmethod
    def parse(cls, spec: "MixedPrecision | str | None") -> "MixedPrecision":
        """Accept a policy, ``None`` (full precision) or a name: ``"bf16"``/``"fp16"`` compute in that
        dtype and reduce in fp32, ``"fp32"`` is full precision."""
        if spec is None:
            return cls()
        if isinstance(spec, MixedPrecision):
            return spec
        if isinstance(spec, str) and spec.lower() in _DTYPES:
            dtype = _DTYPES[spec.lower()]
            return cls() if dtype == torch.float32 else cls(dtype, torch.float32)
        raise ValueError(
            f"mixed_precision={shown(spec)} is not understood: use None, one of "
            f"{sorted(set(_DTYPES))}, or shardwire.MixedPrecision(param_dtype=..., reduce_dtype=...)"
        )
