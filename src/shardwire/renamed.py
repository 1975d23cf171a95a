"""Names kept for one release after a rename, so that scripts, commands and files written for the
old name still run while they are changed: each use warns, naming the new one.

``RenamedWarning`` is a ``FutureWarning`` (shown by default, as it concerns whoever runs the
program), of its own class so that the command line can show it as one line rather than as a
warning's two (the second, a line of shardwire's own source, says nothing to the user).
"""

from __future__ import annotations

import warnings


class RenamedWarning(FutureWarning):
    """An old name was used; the message names the new one and when the old one goes."""


def warn_renamed(what: str, *, stacklevel: int = 2) -> None:
    """Warn that ``what`` ("shardwire.Sync is renamed shardwire.DiLoCo") is in use."""
    warnings.warn(f"{what}; the old name goes in the next release", RenamedWarning, stacklevel=stacklevel + 1)


def renamed_argument(function: str, old: str, new: str, value, *, given_new: bool, note: str = ""):
    """``value``, given to ``function`` as ``old=``, the argument's name before it was renamed
    ``new``: with a warning, for a release; ``given_new`` (both names given) is a ``ValueError``."""
    if given_new:
        raise ValueError(f"{function}() got both {new}= and {old}=, its old name: give {new}= alone")
    warn_renamed(f"{function}({old}=...) is renamed {function}({new}=...){note}", stacklevel=3)
    return value
