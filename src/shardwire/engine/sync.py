"""Sync every H steps across groups (DiLoCo): the settings, and which fragment syncs at which step.

Under the ``hybrid`` layout each group (a node) holds a whole copy of the model, split over its
ranks. Synchronous training all-reduces every gradient shard between the groups at every step,
which on a slow link between nodes is the step. With ``sync`` the groups instead train apart: within
a group the engine shards as ever and its optimizer steps every step (the *inner* optimizer), and no
gradient crosses between groups. Every ``every`` steps (``H``), the change of each group's
parameters since the last sync (DiLoCo's outer gradient, ``anchor - parameters``) is averaged
across the groups and applied to the anchor, the parameters all groups last agreed on (the global
model), by an *outer* optimizer: SGD with Nesterov momentum, by default at DiLoCo's learning rate
0.7 and momentum 0.9 (Douillard et al., 2023; Charles et al., 2025), which BENCHMARKS.md measured
against synchronous training at 20 tokens per parameter and more. Each group then continues from
the new anchor. One group is allowed: the outer step then wraps one optimizer's steps (Lookahead),
which DiLoCo's scaling study found better than data parallelism alone. What crosses nodes is one
all-reduce of the model per ``H`` steps instead of one per step, quantized by ``wire`` (int8 or int4
blocks with error feedback, as ``shard(wire=...)`` quantizes gradients: ``shardwire.comm.wire``;
like every quantized collective, it is exact where the groups share a node).

Streaming (Streaming DiLoCo): with ``fragments`` F, the units are dealt to F fragments in turn
(strided, so each fragment is a slice through the whole depth, which Streaming DiLoCo found better
than contiguous layers), and fragment ``f`` syncs after the steps that are ``(f + 1) H // F``
modulo ``H``: every fragment once per ``H`` steps, one about every ``H / F`` steps, so the link
carries ``1/H`` of the model per step instead of the whole model at once. ``overlap`` lets a sync run
behind that many inner steps before it is applied (up to ``H // F``: torchft's
``fragment_sync_delay``; by default none, as in DiLoCo: the step waits for its sync). Meanwhile the
group goes on from an outer step taken at once with its own change in place of the average (exactly
its own parameters under plain averaging); when the average arrives, the outer step with it replaces
that one under the inner progress made since, which is part of the next sync's change, so every
step's progress is averaged exactly once.

It changes the optimisation: the groups' models differ between syncs, and the outer step is not
the average of the steps synchronous training takes. BENCHMARKS.md measures the validation loss
against synchronous training at equal tokens.

Torch-free, so that the simulator and the planner read the same settings.
"""

from __future__ import annotations

import dataclasses
import math

from shardwire.comm.wire import GRAD_FORMATS, Codec, Wire


@dataclasses.dataclass(frozen=True)
class Sync:
    """How often and how the groups of a ``hybrid`` layout sync (see the module's docstring).

    ``every``: inner steps between two syncs of a fragment (DiLoCo's ``H``). ``fragments``: how many
    parts of the model sync at staggered steps (1: the whole model at once). ``wire``: what the
    averaged change travels as between nodes: None (fp32), "int8" or "int4" (in the wire's default
    blocks, with error feedback). ``outer_lr``, ``momentum``: the outer SGD's learning rate and
    Nesterov momentum. ``overlap``: inner steps a sync runs behind before it is applied, from 0 (the
    step waits for it, the default) to ``every // fragments``."""

    every: int = 20
    fragments: int = 1
    wire: str | None = "int4"
    outer_lr: float = 0.7
    momentum: float = 0.9
    overlap: int | None = 0

    def __post_init__(self):
        if type(self.every) is not int or self.every < 1:
            raise ValueError(f"sync every must be a positive integer (inner steps between syncs), got {self.every!r}")
        if type(self.fragments) is not int or self.fragments < 1:
            raise ValueError(f"sync fragments must be a positive integer, got {self.fragments!r}")
        if self.fragments > self.every:
            raise ValueError(f"sync fragments={self.fragments} is more than every={self.every}: each fragment syncs "
                             f"once every {self.every} steps, and one at a time")
        if self.wire not in (None, *GRAD_FORMATS):
            raise ValueError(f"sync wire must be none, 'int8' or 'int4', got {self.wire!r}")
        if not (isinstance(self.outer_lr, (int, float)) and 0 < self.outer_lr < math.inf):
            raise ValueError(f"sync outer_lr must be a positive number, got {self.outer_lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ValueError(f"sync momentum must be at least 0 and below 1, got {self.momentum!r}")
        if self.overlap is None:  # the default before it was 0: the same run
            object.__setattr__(self, "overlap", 0)
        if type(self.overlap) is not int or not 0 <= self.overlap <= self.spacing:
            raise ValueError(f"sync overlap must be an integer from 0 to every // fragments = {self.spacing} "
                             f"(inner steps a sync runs behind; the next fragment's sync may be due after that), "
                             f"got {self.overlap!r}")

    @classmethod
    def parse(cls, sync: Sync | str | None) -> Sync | None:
        """None or "none": no sync (synchronous training); a ``Sync``; or the command line's form,
        comma-separated ``key=value`` pairs of its fields, e.g. "every=50,fragments=4,wire=int4"
        (the fields left out take their defaults)."""
        if sync is None or isinstance(sync, Sync):
            return sync
        if not isinstance(sync, str):
            raise TypeError(f"sync must be None, a string or a shardwire.Sync, got {type(sync).__name__}")
        if sync.strip() in ("none", ""):
            return None
        fields: dict[str, object] = {}
        names = [field.name for field in dataclasses.fields(cls)]
        for item in sync.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or key not in names:
                raise ValueError(f"sync {sync!r} is not understood: use 'none', or key=value pairs of "
                                 f"{', '.join(names)}, e.g. 'every=50,fragments=4,wire=int4'")
            try:
                fields[key] = _FIELD_TYPES[key](value)
            except ValueError:
                raise ValueError(f"sync {key} must be {_FIELD_WORDS[key]}, got {value!r}") from None
        return cls(**fields)

    @property
    def spacing(self) -> int:
        """The fewest inner steps from one fragment's sync to the next's."""
        return self.every // self.fragments

    def due(self, step: int) -> int | None:
        """The fragment whose sync is issued once ``step`` inner steps are done, if any: fragment ``f``
        after the steps that are ``(f + 1) * every // fragments`` modulo ``every`` (the last fragment
        after every multiple of ``every``, as torchft's Streaming DiLoCo places them)."""
        if step < 1:
            return None
        for fragment in range(self.fragments):
            if step % self.every == (fragment + 1) * self.every // self.fragments % self.every:
                return fragment
        return None

    @property
    def codec(self) -> Codec | None:
        """How the averaged change travels between nodes: as ``Wire(grads=wire)`` quantizes gradients."""
        return Wire(grads=self.wire).grad_codec

    def __str__(self) -> str:
        text = f"every={self.every},fragments={self.fragments},wire={self.wire or 'none'}"
        return f"{text},outer_lr={self.outer_lr!r},momentum={self.momentum!r},overlap={self.overlap}"


def _overlap(text: str) -> int:
    return 0 if text == "none" else int(text)  # "none" was the default's name before it was 0


_FIELD_TYPES = {"every": int, "fragments": int, "wire": lambda text: None if text == "none" else text,
                "outer_lr": float, "momentum": float, "overlap": _overlap}
_FIELD_WORDS = {"every": "a positive integer", "fragments": "a positive integer", "wire": "none, int8 or int4",
                "outer_lr": "a positive number", "momentum": "a number from 0 to below 1",
                "overlap": "an integer"}
