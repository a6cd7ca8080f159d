"""Run statistics in bounded memory, the progress line, and the closing summary."""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from typing import TextIO

#: Log-spaced latency buckets: 2% apart from 0.1 ms to about 3 hours (about 900 counters).
_BASE_MS = 0.1
_GROWTH = 1.02


class LatencyHistogram:
    """Percentiles of any number of samples in constant memory (2% resolution)."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self.n = 0

    def add(self, ms: float) -> None:
        self._counts[max(0, math.ceil(math.log(max(ms, _BASE_MS) / _BASE_MS, _GROWTH)))] += 1
        self.n += 1

    def percentile(self, q: float) -> float:
        """The q-th percentile (0-100), as the upper edge of its bucket; 0.0 when empty."""
        if not self.n:
            return 0.0
        rank = q / 100 * self.n
        seen = 0
        for bucket in sorted(self._counts):
            seen += self._counts[bucket]
            if seen >= rank:
                return _BASE_MS * _GROWTH**bucket
        return _BASE_MS * _GROWTH ** max(self._counts)


class RunStats:
    """Outcomes, latencies and batch sizes of a scoring run."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.outcomes: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()
        self.latency = LatencyHistogram()
        self.skipped = 0
        #: Seconds the command spent before scoring began (a private Redis and worker
        #: starting, the output read back for --resume), for the summary.
        self.startup_s = 0.0

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())

    @property
    def failed(self) -> int:
        """Inputs written as errors (any outcome but ``ok``)."""
        return self.done - self.outcomes["ok"]

    def add(self, outcome: str, latency_ms: float | None, batch_size: int) -> None:
        self.outcomes[outcome] += 1
        if latency_ms is not None:
            self.latency.add(latency_ms)
        if batch_size:
            self.batch_sizes[batch_size] += 1

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items())) or "none"
        lat = self.latency
        lines = [
            f"scored {inputs(self.done)} in {elapsed:.1f} s ({self.rate():.1f}/s), "
            f"{elapsed + self.startup_s:.1f} s in all with {self.startup_s:.1f} s of "
            f"start-up; skipped {self.skipped} already in the output",
            f"outcomes: {outcomes}",
            f"latency p50 {lat.percentile(50):.0f} ms, p95 {lat.percentile(95):.0f} ms, "
            f"p99 {lat.percentile(99):.0f} ms",
            "batch sizes (requests): " + (", ".join(
                f"{k}: {v}" for k, v in sorted(self.batch_sizes.items())) or "none"),
        ]
        return "\n".join(lines)


def inputs(n: int) -> str:
    """``1 input``, ``2 inputs``."""
    return f"{n} input{'' if n == 1 else 's'}"


def verdict(stats: RunStats, complete: bool, interrupted: bool,
            max_error_rate: float) -> tuple[int, str]:
    """The exit code of a scoring run and the one line that says why, counting every input:
    130 when interrupted (the rest is left to --resume), 1 when an input has no record or
    more than ``max_error_rate`` (a share, 0-1) of the inputs scored failed, else 0."""
    done, failed = stats.done, stats.failed
    share = failed / done if done else 0.0
    codes = ", ".join(f"{k}: {v}" for k, v in sorted(stats.outcomes.items()) if k != "ok")
    counted = f"{inputs(done)} scored ({stats.outcomes['ok']} ok, {failed} failed" + \
        (f": {codes})" if codes else ")") + f", {stats.skipped} already in the output"
    if interrupted:
        return 130, f"interrupted: {counted}; rerun with --resume to score the rest"
    if not complete:
        return 1, f"Error: the run ended early: {counted}; rerun with --resume"
    allowed = f"--max-error-rate {max_error_rate:.0%}"
    if share > max_error_rate:
        return 1, f"Error: {share:.0%} of the inputs failed, over {allowed}: {counted}"
    return 0, f"done: {counted}; {share:.0%} failed, within {allowed}"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """A one-line bar with rate and ETA on a terminal; a plain line every so often otherwise."""

    def __init__(self, stats: RunStats, stream: TextIO = sys.stderr,
                 plain_every_s: float = 10.0) -> None:
        self.stats = stats
        self.stream = stream
        self.total: int | None = None
        self._tty = stream.isatty()
        self._every = 0.2 if self._tty else plain_every_s
        self._last = 0.0
        self._written = (-1, -1)  # (done, skipped) of the last line written

    def line(self) -> str:
        done, rate = self.stats.done, self.stats.rate()
        if self.total:
            left = max(0, self.total - self.stats.skipped - done)
            eta = _clock(left / rate) if rate > 0 else "?"
            share = min(1.0, (done + self.stats.skipped) / self.total)
            bar = "#" * int(share * 30)
            return f"[{bar:<30}] {done + self.stats.skipped}/{self.total} " \
                   f"{share:6.1%}  {rate:7.1f}/s  ETA {eta}"
        return f"{done} scored  {rate:7.1f}/s"

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._every:
            return
        self._last = now
        counts = (self.stats.done, self.stats.skipped)
        if self._tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        elif counts != self._written:  # off a terminal, no second line for the same counts
            self.stream.write(self.line() + "\n")
        self._written = counts
        self.stream.flush()

    def finish(self) -> None:
        self.update(force=True)
        if self._tty:
            self.stream.write("\n")
