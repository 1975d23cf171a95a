"""A one-line progress bar for training: redrawn in place on a terminal, a plain line per update
otherwise (logs, CI), so it reads well in both."""

from __future__ import annotations

import sys
import time


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
        self.interactive = self.stream.isatty()
        self._start_step = start
        self._started = time.monotonic()

    def update(self, step: int, fields: dict[str, str]) -> None:
        """Show ``step`` (1-based, of ``total``) and the given ``name: value`` fields."""
        done = step / self.total
        filled = int(done * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._started
        steps_run = step - self._start_step
        eta = elapsed / steps_run * (self.total - step) if steps_run else 0.0
        text = "  ".join(f"{name} {value}" for name, value in fields.items())
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {text}  eta {format_duration(eta)}"
        if self.interactive:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
