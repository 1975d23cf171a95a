"""Names kept for one release after a rename, so that scripts, commands and files written for the
old name still run while they are changed: each use warns, naming the new one.

``RenamedWarning`` is a ``FutureWarning`` (shown by default, as it concerns whoever runs the
program), of its own class so that the command line can show it as one line rather than as a
warning's two (the second, a line of shardwire's own source, says nothing to the user).
"""

from __future__ import annotations

import functools
import warnings


class RenamedWarning(FutureWarning):
    """An old name was used; the message names the new one and when the old one goes."""


def warn_renamed(what: str, *, stacklevel: int = 2) -> None:
    """Warn that ``what`` ("shardwire.Sync is renamed shardwire.DiLoCo") is in use."""
    warnings.warn(f"{what}; the old name goes in the next release", RenamedWarning, stacklevel=stacklevel + 1)


def renamed_keywords(renames: dict[str, str], notes: dict[str, str] | None = None):
    """Decorate a function whose keyword arguments were renamed (``{old: new}``): for a release a call
    may still pass ``old=``, taken as ``new=`` with a warning (``notes[old]`` added to it). Whether
    ``new=`` was given too is read from the call itself, never from the value: ``layout="full"``,
    its default, given beside ``sharding=`` is as much a conflict as any other value, and is refused
    naming both rather than losing one of them silently."""
    def decorate(function):
        @functools.wraps(function)
        def called(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    kwargs[new] = _renamed_value(function.__name__, old, new, kwargs, (notes or {}).get(old, ""))
            return function(*args, **kwargs)
        return called
    return decorate


def _renamed_value(function: str, old: str, new: str, kwargs: dict, note: str):
    """The value passed as ``old=`` (taken out of ``kwargs``), with its warning; ``new=`` given as
    well is a ``ValueError`` naming both."""
    if new in kwargs:
        raise ValueError(f"{function}() got both {new}= and {old}=, its old name: give {new}= alone")
    warn_renamed(f"{function}({old}=...) is renamed {function}({new}=...){note}", stacklevel=3)
    return kwargs.pop(old)
