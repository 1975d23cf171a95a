"""Sync every H steps across groups (DiLoCo): the settings, and which fragment syncs at which step.

Under the ``hybrid`` layout each group (a node) holds a whole copy of the model, split over its
ranks. Synchronous training all-reduces every gradient shard between the groups at every step,
which on a slow link between nodes is the step. With ``sync`` the groups instead train apart: within
a group the engine shards as ever and its optimizer steps every step (the *inner* optimizer), and no
gradient crosses between groups. Every ``every`` steps (``H``), the change of each group's
parameters since the last sync (DiLoCo's outer gradient, ``anchor - parameters``) is averaged
across the groups and applied to the anchor, the parameters all groups last agreed on, by an
*outer* optimizer: SGD with Nesterov momentum. Its defaults, learning rate 1 and no momentum (the
anchor becomes the groups' mean), are what BENCHMARKS.md measured best at equal tokens; DiLoCo's
0.7 and 0.9, tuned on runs of many more outer steps, ended further from synchronous training there.
Each group then continues from the new anchor. What crosses nodes is one all-reduce of the model
per ``H`` steps instead of one per step, quantized by ``wire`` (int8 or int4 blocks with error
feedback, as ``shard(wire=...)`` quantizes gradients: ``shardwire.comm.wire``).

Streaming (Streaming DiLoCo): with ``fragments`` F, the units are dealt to F fragments in turn
(strided, so each fragment is a slice through the whole depth, which Streaming DiLoCo found better
than contiguous layers), and fragment ``f`` syncs after the steps that are ``(f + 1) H // F``
modulo ``H``: every fragment once per ``H`` steps, one about every ``H / F`` steps. Each sync is
issued when the training forward after its step starts and runs behind the next ``overlap`` inner
steps (by default ``H // F``, until the next fragment's sync is due), so the link carries ``1/H``
of the model per step, all the time, instead of the whole model at once. Without fragments the
default is no overlap, as in DiLoCo: a whole model that runs a period behind leaves the groups
apart for two. Meanwhile the group goes on from an outer step taken at once with its own change in
place of the average (Kale et al.'s eager updates, 2025); when the average arrives, the true outer
step replaces it under the inner progress made since, which is part of the next sync's change (so
every step's progress is averaged exactly once). ``overlap=0`` is DiLoCo itself: the step waits
for its sync.

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
    blocks, with error feedback). ``outer_lr``, ``momentum``: the outer SGD's
    learning rate and Nesterov momentum. ``overlap``: inner steps a sync runs behind before it is
    applied, from 0 (the step waits for it) to ``every // fragments`` (None, the default: that
    many in fragments, until the next fragment's sync; 0 for the whole model at once)."""

    every: int = 20
    fragments: int = 4
    wire: str | None = "int4"
    outer_lr: float = 1.0
    momentum: float = 0.0
    overlap: int | None = None

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
        if self.overlap is not None and (type(self.overlap) is not int or not 0 <= self.overlap <= self.spacing):
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

    @property
    def lag(self) -> int:
        """Inner steps a sync runs behind: ``overlap``; by default, in fragments, until the next
        fragment's is due (the spacing), and for the whole model at once none: a sync that runs
        behind all of ``every`` would leave each group on its own for two periods."""
        if self.overlap is not None:
            return self.overlap
        return self.spacing if self.fragments > 1 else 0

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
        text += f",outer_lr={self.outer_lr!r},momentum={self.momentum!r}"
        return text if self.overlap is None else f"{text},overlap={self.overlap}"


def _optional_int(text: str) -> int | None:
    return None if text == "none" else int(text)


_FIELD_TYPES = {"every": int, "fragments": int, "wire": lambda text: None if text == "none" else text,
                "outer_lr": float, "momentum": float, "overlap": _optional_int}
_FIELD_WORDS = {"every": "a positive integer", "fragments": "a positive integer", "wire": "none, int8 or int4",
                "outer_lr": "a positive number", "momentum": "a number from 0 to below 1",
                "overlap": "an integer, or none"}
