"""Rank 0's progress: tqdm's bar on a terminal, one plain line every few seconds elsewhere.

Under horovodrun a rank's stderr is a pipe to mpirun, never a terminal: a bar that redraws
every step writes a carriage-return line per step into the job's log (50-100 KB for a short
digits run, tagged and unreadable). :class:`LineProgress` keeps tqdm's interface (``update``,
``set_postfix``, ``close``) and writes one line every ``every_s`` seconds and one at the end.
"""
from __future__ import annotations

import time

EVERY_S = 5.0


def progress_bar(total: int, initial: int, desc: str, stream, every_s: float = EVERY_S):
    """A tqdm bar when ``stream`` is a terminal, else a :class:`LineProgress`."""
    if stream.isatty():
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc=desc, unit="step", file=stream)
    return LineProgress(total, initial, desc, stream, every_s)


class LineProgress:
    """``desc: step 120/440 (27%), 65.2 steps/s, 0:05 elapsed, 0:05 left, loss=2.288``, every
    ``every_s`` seconds of steps and once at :meth:`close`."""

    def __init__(self, total: int, initial: int, desc: str, stream, every_s: float = EVERY_S,
                 clock=time.monotonic):
        self.total, self.n, self.desc, self.stream = total, initial, desc, stream
        self.every_s, self.clock = every_s, clock
        self.start_n, self.start = initial, clock()
        self.last, self.shown = self.start, initial
        self.postfix = ""
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.every_s:
            self._line()

    def set_postfix(self, refresh: bool = True, **values) -> None:
        """Shown with the next line (tqdm's keyword form; ``refresh`` is tqdm's and changes nothing here)."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n != self.shown:
                self._line()

    def _line(self) -> None:
        now = self.clock()
        self.last, self.shown = now, self.n
        elapsed = now - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        left = f", {_clock(max(0, self.total - self.n) / rate)} left" if rate > 0 and self.n < self.total else ""
        percent = 100 * self.n / self.total if self.total else 100.0
        text = (f"{self.desc}: step {self.n}/{self.total} ({percent:.0f}%), {rate:.1f} steps/s, "
                f"{_clock(elapsed)} elapsed{left}" + (f", {self.postfix}" if self.postfix else ""))
        self.stream.write(text + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"
