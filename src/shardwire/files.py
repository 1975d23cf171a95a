"""Writing files so that a reader never finds one half-written.

Every file shardwire writes (profiles, traces, reports, plots, benchmark results, token caches,
exported state dicts, the testbed's state and hosts files) goes through ``write_atomically``: the
data goes to a temporary file beside the target, which then replaces the target in one rename. A
crash, a full disk or an error while rendering leaves the target as it was and no temporary file
behind. (Checkpoints are written a
directory at a time, with the same idea: ``shardwire.engine.checkpoint.save``.)
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile


def write_atomically(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> None:
    """Make ``path`` hold exactly ``data``, or leave it as it was. With ``durable`` the data is on
    disk, not only in the page cache, before the rename (for results that must survive a power loss)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory: give a file name")
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def figure_png(figure) -> bytes:
    """A finished matplotlib figure as PNG bytes (to write with ``write_atomically``), and the
    figure closed: a report of many runs would otherwise pile figures up."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=120)
    finally:
        plt.close(figure)
    return buffer.getvalue()
