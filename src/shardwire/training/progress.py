"""Training progress, one update per log interval: tqdm's bar, redrawn in place, on a terminal; a
plain line per update otherwise (logs, CI, pipes), where a redrawn bar would only pile up carriage
returns."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


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
