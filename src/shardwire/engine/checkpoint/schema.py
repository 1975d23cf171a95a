"""Reading untrusted JSON (a checkpoint's manifest): every value checked for the type and range it must
have before anything uses it, and otherwise a ``ValueError`` naming the field and what it holds.

A manifest can be damaged, written by another program or edited by hand. A wrong value that got
through would fail far from here (a step of ``"3"`` in ``range``), or worse, work wrongly (a step of
-1 as a data position, a file name of ``../x`` read from outside the checkpoint), so nothing in it is
taken on trust. ``what`` is the field's path in the manifest (``flats[2].slots[0].shape``).
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Collection

from shardwire.mappings import shown

_SHA256 = re.compile(r"[0-9a-f]{64}")


def fields(value, what: str, keys: Collection[str], *, open_ended: bool = False) -> dict:
    """``value`` as a JSON object holding ``keys`` and, unless ``open_ended``, nothing else."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {shown(value)}, not an object")
    missing = [key for key in keys if key not in value]
    if missing:
        raise ValueError(f"{what} has no {missing[0]!r}")
    unexpected = sorted(value.keys() - set(keys))
    if unexpected and not open_ended:
        raise ValueError(f"{what} has an unexpected field {unexpected[0]!r}")
    return value


def array(value, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what} is {shown(value)}, not a list")
    return value


def string(value, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is {shown(value)}, not a string")
    return value


def integer(value, what: str, minimum: int = 0) -> int:
    """An integer of at least ``minimum``; ``True`` is not one, although Python's ``bool`` is an ``int``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} is {shown(value)}, not an integer >= {minimum}")
    return value


def one_of(value, what: str, choices: Collection[str]) -> str:
    if value not in choices:
        raise ValueError(f"{what} is {shown(value)}, not one of {', '.join(map(repr, choices))}")
    return value


def sha256(value, what: str) -> str:
    if not isinstance(value, str) or _SHA256.fullmatch(value) is None:
        raise ValueError(f"{what} is {shown(value)}, not a sha256 (64 lowercase hex digits)")
    return value


def plain_name(value, what: str) -> str:
    """A file name that stays in its directory on every platform: no separator, drive, ``..`` or ``.``."""
    if (not isinstance(value, str) or value in ("", ".", "..") or "\0" in value
            or pathlib.PurePosixPath(value).name != value or pathlib.PureWindowsPath(value).name != value):
        raise ValueError(f"{what} is {shown(value)}, not a plain file name inside the checkpoint directory")
    return value


def unique(values: list[str], what: str) -> list[str]:
    seen = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} holds {value!r} twice")
        seen.add(value)
    return values


def fits(saved, current) -> bool:
    """Whether a value read from JSON can stand for ``current``, the value a live object (an optimizer's
    param group, a scheduler) holds now: a bool for a bool, a number for a number, a string for a
    string, a list as long with fitting items for a list or tuple. Anything may stand for anything
    else, None among them ("let torch choose", as an optimizer's ``foreach`` is by default)."""
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(fits, saved, current))
    if isinstance(current, str):
        return isinstance(saved, str)
    return True
