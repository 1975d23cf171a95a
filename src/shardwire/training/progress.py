"""Training progress, one update per log interval: tqdm's bar, redrawn in place, on a terminal; a
plain line per update otherwise (logs, CI, pipes), where a redrawn bar would only pile up carriage
returns.

Standard output is the run's log like any other (``shardwire.training.scalars``): one that can no
longer be written (``| head``, whose reader has left; a file on a full disk) is one line on stderr
and the end of what the run prints there, not of the run (``until_closed``)."""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm

from shardwire.launch import UntilClosed


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s < 1e6 else f"{tokens_per_s / 1e6:.2f}M"


class ProgressBar:
    def __init__(self, total: int, start: int = 0, width: int = 24, stream=None):
        self.total = total
        self.width = width
        self.stream = stream or sys.stdout
        self._start_step = start
        self._started = time.monotonic()
        self._bar = (tqdm(total=total, initial=start, file=self.stream, unit="step", dynamic_ncols=True,
                          bar_format="step {n_fmt}/{total_fmt} |{bar}| {desc}  eta {remaining}")
                     if self.stream.isatty() else None)

    def update(self, step: int, fields: dict[str, str]) -> None:
        """Show ``step`` (1-based, of ``total``) and the given ``name: value`` fields."""
        text = "  ".join(f"{name} {value}" for name, value in fields.items())
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        filled = int(step / self.total * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        steps_run = step - self._start_step
        eta = (time.monotonic() - self._started) / steps_run * (self.total - step) if steps_run else 0.0
        counter = f"{step:>{len(str(self.total))}}/{self.total}"
        self.stream.write(f"step {counter} [{bar}] {text}  eta {format_duration(eta)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def until_closed():
    """Within it, standard output ends at its first write that fails, with one line on stderr: what
    is printed after, and what that write left in the stream's buffer (written again at each flush,
    and as the process ends), goes to the null device. Python ignores SIGPIPE, so a reader that has
    left (``| head``) is an error at the next write, whichever line of the run it is. (A process
    started with no standard output at all, ``>&-``, has the null device for it: ``cli.entry``.)"""
    with contextlib.redirect_stdout(UntilClosed(sys.stdout, _say_closed)):
        yield


def _say_closed(err: OSError) -> None:
    with contextlib.suppress(OSError):  # where it is said may be the same lost reader (2>&1 | head)
        print(f"warning: standard output: {err.strerror or err}; training goes on without printing its progress",
              file=sys.stderr, flush=True)
