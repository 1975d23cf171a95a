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
