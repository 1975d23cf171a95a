"""What collectives put on the wire between nodes: full precision, or block-wise quantized integers.

On a slow link the bytes are the step. ``Wire`` says, for parameter gathers and gradient
reductions separately, whether the bytes that cross nodes are the tensors themselves or their
quantized form (DeepSpeed ZeRO++'s qwZ and qgZ): int8 parameters, int8 or int4 gradients.
Only collectives whose group spans nodes quantize: a gather then sends every rank's shard quantized,
within the node too (every rank must compute with the same values), and a reduction only the
partial sums that cross nodes. Where every rank of a group shares a node, nothing is quantized.

A ``Codec`` quantizes rows of values block by block, symmetrically: each block of ``block``
consecutive elements gets one fp32 scale, its largest magnitude over the largest integer of the
format, and each element becomes the nearest integer multiple of that scale, so no element moves by
more than half a step (``scale / 2``). A row travels as one byte buffer, its integers (two per byte
for int4) followed by its scales, so a collective of bytes carries it unchanged on gloo and NCCL.
The kernels are in ``shardwire.comm.quantize``; this module is plain arithmetic, which the simulator
and planner read without importing torch.

Bytes per element on the wire, for a block of B elements: int8 ``1 + 4/B``, int4 ``1/2 + 4/B``,
against 4 (fp32) or 2 (bf16) without quantization. ``DEFAULT_BLOCK`` is 256 (measured with
``benchmarks/wire_codec.py``, in BENCHMARKS.md), where the scales add 1.6% to int8.
"""

from __future__ import annotations

import dataclasses
import math

from shardwire.mappings import shown
from shardwire.options import setting_error

DEFAULT_BLOCK = 256
# Elements per scale: more than any unit's shard holds (Llama 2 70B's blocks hold 0.86B parameters),
# and every shard is padded to whole blocks, so a larger block only adds bytes.
MAX_BLOCK = 2**30
PARAM_FORMATS = ("int8",)
GRAD_FORMATS = ("int8", "int4")
_BITS = {"int8": 8, "int4": 4}
SCALE_BYTES = 4  # one fp32 per block


def formats_named(formats: tuple[str, ...], nothing: str = "None") -> str:
    """``formats`` or ``nothing`` (full precision, as the caller's users spell it), as a message
    offers them: "None, 'int8' or 'int4'"."""
    *rest, last = [nothing, *(repr(name) for name in formats)]
    return f"{', '.join(rest)} or {last}"


@dataclasses.dataclass(frozen=True)
class Codec:
    """Block-wise symmetric quantization to ``bits`` (2, 4 or 8: whole integers to a byte, and at
    least one level either side of 0) with blocks of ``block`` elements."""

    bits: int
    block: int

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"a codec packs whole signed integers into bytes: bits must be 2, 4 or 8, got {self.bits}")

    @property
    def largest(self) -> int:
        """The largest integer magnitude: 127 for int8, 7 for int4 (symmetric, so -8 is unused)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def offset(self) -> int:
        """What makes an integer unsigned for packing below 8 bits: 8 for int4."""
        return 1 << (self.bits - 1)

    def blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def packed_numel(self, numel: int) -> int:
        """Bytes one row of ``numel`` values takes on the wire."""
        blocks = self.blocks(numel)
        return math.ceil(blocks * self.block * self.bits / 8) + blocks * SCALE_BYTES

    def wire_bytes_per_element(self, numel: int) -> float:
        return self.packed_numel(numel) / numel


@dataclasses.dataclass(frozen=True)
class Wire:
    """The wire format of a sharded model's collectives between nodes.

    ``params``: ``None`` (the compute dtype) or "int8", for parameter all-gathers. ``grads``:
    ``None`` (the reduce dtype), "int8" or "int4", for gradient reduce-scatters (and hybrid
    sharding's all-reduce between groups). ``block``: elements per scale. ``error_feedback``: each
    rank keeps what quantizing its gradients lost and adds it to the next step's (on by default:
    without it int4 gradients bias training). Master weights and optimizer state stay exact."""

    params: str | None = None
    grads: str | None = None
    block: int = DEFAULT_BLOCK
    error_feedback: bool = True

    def __post_init__(self):
        if self.params == "int4":
            raise setting_error(
                "wire", "params='int4' is not supported: 16 levels per block lose too much of the weights "
                "every rank computes with. Use params='int8' (and grads='int4' for the smallest wire)"
            )
        if self.params not in (None, *PARAM_FORMATS):
            raise setting_error("wire", f"params must be {formats_named(PARAM_FORMATS)}, got {shown(self.params)}")
        if self.grads not in (None, *GRAD_FORMATS):
            raise setting_error("wire", f"grads must be {formats_named(GRAD_FORMATS)}, got {shown(self.grads)}")
        if type(self.block) is not int or not 1 <= self.block <= MAX_BLOCK:
            raise setting_error("wire", f"block must be a positive integer (elements per scale) of at most "
                                        f"{MAX_BLOCK:,}, got {shown(self.block)}")
        if self.grads is not None and self.block * _BITS[self.grads] % (8 * SCALE_BYTES):
            # a quantized reduction reads each block's packed integers beside its fp32 scale, in place
            multiple = 8 * SCALE_BYTES // math.gcd(8 * SCALE_BYTES, _BITS[self.grads])
            raise setting_error("wire", f"block must be a multiple of {multiple} with grads={self.grads} (its "
                                        f"packed values fill whole 4-byte words, as its scales are read beside "
                                        f"them), got {self.block}")

    @classmethod
    def parse(cls, wire: "Wire | str | None") -> "Wire":
        """``None`` or "none": full precision; "int8": int8 parameters and gradients; or the
        command line's form, comma-separated ``key=value`` pairs, e.g. "params=int8,grads=int4,block=128"
        (``error_feedback=off`` turns feedback off)."""
        if wire is None or isinstance(wire, Wire):
            return wire or cls()
        if not isinstance(wire, str):
            raise TypeError(f"wire must be None, a string or a shardwire.Wire, got {type(wire).__name__}")
        if wire in ("none", ""):
            return cls()
        if wire == "int8":
            return cls(params="int8", grads="int8")
        fields: dict[str, object] = {}
        for item in wire.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in ("params", "grads", "block", "error_feedback"):
                raise setting_error(
                    "wire", f"{shown(wire)} is not understood: use 'none', 'int8', or key=value pairs of params, "
                    f"grads, block and error_feedback, e.g. 'params=int8,grads=int4'"
                )
            if key in fields:  # the last would win silently, over a value the user also meant
                raise setting_error("wire", f"{key} is given twice (the last would win silently): give it once")
            if key == "block":
                if not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_BLOCK)):
                    raise setting_error("wire", f"block must be a positive integer of at most {MAX_BLOCK:,}, "
                                     f"got {shown(value)}")
                fields[key] = int(value)
            elif key == "error_feedback":
                if value not in ("on", "off"):
                    raise setting_error("wire", f"error_feedback must be 'on' or 'off', got {shown(value)}")
                fields[key] = value == "on"
            else:
                fields[key] = None if value == "none" else value
        return cls(**fields)

    @property
    def quantized(self) -> bool:
        return self.params is not None or self.grads is not None

    @property
    def param_codec(self) -> Codec | None:
        return None if self.params is None else Codec(_BITS[self.params], self.block)

    @property
    def grad_codec(self) -> Codec | None:
        return None if self.grads is None else Codec(_BITS[self.grads], self.block)

    def __str__(self) -> str:
        if not self.quantized:
            return "none"
        text = f"params={self.params or 'none'},grads={self.grads or 'none'}"
        if self.block != DEFAULT_BLOCK:
            text += f",block={self.block}"
        return text + ("" if self.error_feedback else ",error_feedback=off")
