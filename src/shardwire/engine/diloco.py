"""DiLoCo, syncing every H steps across groups: the settings, and which fragment syncs at which step.

Under the ``hybrid`` layout each group (a node) holds a whole copy of the model, split over its
ranks. Synchronous training all-reduces every gradient shard between the groups at every step,
which on a slow link between nodes is the step. With ``diloco`` the groups instead train apart:
within a group the engine shards as ever and its optimizer steps every step (the *inner*
optimizer), and no gradient crosses between groups. Every ``sync_every`` steps (``H``), the change
of each group's parameters since the last sync (DiLoCo's outer gradient, ``anchor - parameters``) is averaged
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
carries ``1/H`` of the model per step instead of the whole model at once. ``fragment_sync_delay``
lets a sync run behind that many inner steps before it is applied (up to ``H // F``; by default none,
as in DiLoCo: the step waits for its sync). Meanwhile the group goes on from an outer step taken at
once with its own change in place of the average (exactly its own parameters under plain averaging);
when the average arrives, the outer step with it replaces that one under the inner progress made
since, which is part of the next sync's change, so every step's progress is averaged exactly once.

It changes the optimisation: the groups' models differ between syncs, and the outer step is not
the average of the steps synchronous training takes. BENCHMARKS.md measures the validation loss
against synchronous training at equal tokens.

The names are torchft's (``DiLoCo``, ``sync_every``, ``fragment_sync_delay``), which also keep them
apart from ``no_sync`` and ``sync_gradients``, which switch gradient reduction off. The names before
(``Sync``, ``every``, ``overlap``) still work for a release, with a warning (``shardwire.renamed``).

Torch-free, so that the simulator and the planner read the same settings.
"""

from __future__ import annotations

import dataclasses

from shardwire.comm.wire import GRAD_FORMATS, Codec, Wire, formats_named
from shardwire.mappings import shown
from shardwire.options import MAX_COUNT, below_float32, setting_error, settings_fields, whole_number
from shardwire.renamed import warn_renamed

# The fields' names before torchft's, kept for a release: old -> new.
RENAMED_FIELDS = {"every": "sync_every", "overlap": "fragment_sync_delay"}
_RENAMED = ", ".join(f"{old} -> {new}" for old, new in RENAMED_FIELDS.items())
# The largest outer learning rate: DiLoCo's is 0.7, and an outer step of more than ten times the
# groups' averaged change moves the model farther than they trained; far larger ones overflow fp32
# (1e308 times any change is inf at the first outer step).
MAX_OUTER_LR = 10.0


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """How often and how the groups of a ``hybrid`` layout sync (see the module's docstring).

    ``sync_every``: inner steps between two syncs of a fragment (DiLoCo's ``H``). ``fragments``: how
    many parts of the model sync at staggered steps (1: the whole model at once). ``wire``: what the
    averaged change travels as between nodes: None (fp32), "int8" or "int4" (in the wire's default
    blocks, with error feedback). ``outer_lr``, ``momentum``: the outer SGD's learning rate and
    Nesterov momentum. ``fragment_sync_delay``: inner steps a sync runs behind before it is applied,
    from 0 (the step waits for it, the default) to ``sync_every // fragments``."""

    sync_every: int = 20
    fragments: int = 1
    wire: str | None = "int4"
    outer_lr: float = 0.7
    momentum: float = 0.9
    fragment_sync_delay: int | None = 0

    def __post_init__(self):
        if type(self.sync_every) is not int or not 1 <= self.sync_every <= MAX_COUNT:
            raise setting_error("diloco", f"sync_every must be a positive integer of at most {MAX_COUNT:,} (inner "
                                          f"steps between syncs), got {shown(self.sync_every)}")
        if type(self.fragments) is not int or self.fragments < 1:
            raise setting_error("diloco", f"fragments must be a positive integer, got {shown(self.fragments)}")
        if self.fragments > self.sync_every:
            raise setting_error("diloco", f"fragments={self.fragments} is more than sync_every={self.sync_every}: each "
                                          f"fragment syncs once every {self.sync_every} steps, and one at a time")
        if self.wire not in (None, *GRAD_FORMATS):
            raise setting_error("diloco", f"wire must be {formats_named(GRAD_FORMATS, 'none')}, got {shown(self.wire)}")
        if not (isinstance(self.outer_lr, (int, float)) and 0 < self.outer_lr <= MAX_OUTER_LR):
            raise setting_error("diloco", f"outer_lr must be a positive number of at most {MAX_OUTER_LR:g} "
                                          f"(DiLoCo's is 0.7), got {shown(self.outer_lr)}")
        if (needed := below_float32(self.outer_lr)) is not None:
            raise setting_error("diloco", f"outer_lr must be {needed}, got {shown(self.outer_lr)}")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise setting_error("diloco", f"momentum must be at least 0 and below 1, got {shown(self.momentum)}")
        if self.fragment_sync_delay is None:  # the default before it was 0: the same run
            object.__setattr__(self, "fragment_sync_delay", 0)
        if type(self.fragment_sync_delay) is not int or not 0 <= self.fragment_sync_delay <= self.spacing:
            raise setting_error("diloco", f"fragment_sync_delay must be an integer from 0 to sync_every // "
                                          f"fragments = {self.spacing} (inner steps a sync runs behind; the next "
                                          f"fragment's sync may be due after that), got "
                                          f"{shown(self.fragment_sync_delay)}")

    @classmethod
    def parse(cls, diloco: DiLoCo | str | None) -> DiLoCo | None:
        """None or "none": no DiLoCo (synchronous training); a ``DiLoCo``; or the command line's form,
        comma-separated ``key=value`` pairs of its fields, e.g. "sync_every=50,fragments=4,wire=int4"
        (the fields left out take their defaults). The keys ``every`` and ``overlap`` are read as
        ``sync_every`` and ``fragment_sync_delay``, with a warning, for a release."""
        if diloco is None or isinstance(diloco, DiLoCo):
            return diloco
        if not isinstance(diloco, str):
            raise TypeError(f"diloco must be None, a string or a shardwire.DiLoCo, got {type(diloco).__name__}")
        if diloco.strip() in ("none", ""):
            return None
        fields, old_names = settings_fields(
            diloco, _FIELD_TYPES, setting="diloco", renamed=RENAMED_FIELDS,
            remedy=f"use 'none', or key=value pairs of {', '.join(_FIELD_TYPES)}, e.g. "
                   f"'sync_every=50,fragments=4,wire=int4'",
            bad_value=lambda key, value: f"{key} must be {_FIELD_WORDS[key]}, got {value}",
            twice=lambda key: f"{key} is given twice (the last would win silently): give it once")
        if old_names:
            warn_renamed(f"diloco {', '.join(f'{old}= is renamed {RENAMED_FIELDS[old]}=' for old in old_names)}")
        return cls(**fields)

    def check_units(self, trainable: int) -> None:
        """Fragments are made of whole units with trainable parameters: refuse more fragments than
        the ``trainable`` units a model has (``shard`` counts them; ``shardwire train`` before its
        workers start)."""
        if self.fragments > trainable:
            raise setting_error("diloco", f"fragments={self.fragments} is more than the {trainable} units with "
                                          f"trainable parameters (each fragment is whole units): use at most "
                                          f"{trainable}, or more units")

    @property
    def spacing(self) -> int:
        """The fewest inner steps from one fragment's sync to the next's."""
        return self.sync_every // self.fragments

    def due(self, step: int) -> int | None:
        """The fragment whose sync is issued once ``step`` inner steps are done, if any: fragment ``f``
        after the steps that are ``(f + 1) * sync_every // fragments`` modulo ``sync_every`` (the last
        fragment after every multiple of ``sync_every``, as torchft's Streaming DiLoCo places them)."""
        if step < 1:
            return None
        for fragment in range(self.fragments):
            if step % self.sync_every == (fragment + 1) * self.sync_every // self.fragments % self.sync_every:
                return fragment
        return None

    def next_due(self, step: int) -> int:
        """The first step after ``step`` once which a fragment's sync is due."""
        return next(later for later in range(step + 1, step + self.sync_every + 1) if self.due(later) is not None)

    def agreed_after(self, step: int, last: int) -> bool:
        """Whether every group holds the model they agree on once ``step`` inner steps are done, of a
        run of ``last``: at its last step, which ends with a sync of the whole model, or at a sync of
        the whole model at once, applied as it is issued. Between, each group holds inner steps of
        its own."""
        return step == last or (self.fragments == 1 and not self.fragment_sync_delay and step % self.sync_every == 0)

    @property
    def codec(self) -> Codec | None:
        """How the averaged change travels between nodes: as ``Wire(grads=wire)`` quantizes gradients."""
        return Wire(grads=self.wire).grad_codec

    def __str__(self) -> str:
        text = f"sync_every={self.sync_every},fragments={self.fragments},wire={self.wire or 'none'}"
        return (f"{text},outer_lr={self.outer_lr!r},momentum={self.momentum!r},"
                f"fragment_sync_delay={self.fragment_sync_delay}")


def Sync(**fields) -> DiLoCo:  # noqa: N802 (the old class's name, kept callable for a release)
    """``shardwire.DiLoCo`` under its name before torchft's, with ``every`` for ``sync_every`` and
    ``overlap`` for ``fragment_sync_delay``: warns, and returns the same settings as a ``DiLoCo``."""
    warn_renamed(f"shardwire.Sync is renamed shardwire.DiLoCo ({_RENAMED})")
    for old, new in RENAMED_FIELDS.items():
        if old in fields:
            if new in fields:
                raise TypeError(f"shardwire.Sync got both {old} and {new}: give {new}")
            fields[new] = fields.pop(old)
    return DiLoCo(**fields)


def current_keys(text: str) -> str:
    """``--diloco``'s value as the workers and ``--print-config`` are given it: where it names a
    field by its old name, read (``DiLoCo.parse`` warns) and written whole under the new names, so
    that nothing after the command line speaks of the old one. A value that does not parse is left
    as written, to be refused where it is checked."""
    if not uses_renamed_keys(text):
        return text
    try:
        return str(DiLoCo.parse(text))
    except ValueError:
        return text


def uses_renamed_keys(text: str | None) -> bool:
    """Whether the command line's form ``text`` names a field by its name before torchft's."""
    return isinstance(text, str) and any(item.partition("=")[0].strip() in RENAMED_FIELDS
                                         for item in text.split(",") if "=" in item)


def _fragment_sync_delay(text: str) -> int:
    return 0 if text == "none" else whole_number(text)  # "none" was the default's name before it was 0


_FIELD_TYPES = {"sync_every": int, "fragments": int, "wire": lambda text: None if text == "none" else text,
                "outer_lr": float, "momentum": float, "fragment_sync_delay": _fragment_sync_delay}
_FIELD_WORDS = {"sync_every": "a positive integer", "fragments": "a positive integer", "wire": "none, int8 or int4",
                "outer_lr": f"a positive number of at most {MAX_OUTER_LR:g}", "momentum": "a number from 0 to below 1",
                "fragment_sync_delay": "an integer"}
