"""Showing a FleetStatus: one plain-text table (``redbatch status``), redrawn live (``top``).

Plain text and plain ANSI only (home, clear to end of line and of screen), so it works
over SSH, in tmux and in any terminal without curses.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TextIO

from redbatch.cli.fleet_state import FleetStatus, ModelStatus, WorkerStatus

LANE_COLUMNS = ("MODEL", "LANE", "LENGTH", "PENDING", "LAG", "DLQ", "WORKERS", "LAST_BEAT",
                "PARTS", "RESULTS/S", "P50_MS", "P99_MS", "ERRORS")
WORKER_COLUMNS = ("WORKER", "MODEL", "STATE", "HOST", "PID", "DEVICE", "MAX_BATCH", "INFLIGHT",
                  "LAST_BEAT", "UP", "VERSION", "METRICS")
_LEFT = {"MODEL", "LANE", "WORKER", "STATE", "HOST", "DEVICE", "VERSION"}

# Home, then each line followed by clear-to-end-of-line, then clear the rest: the new
# frame overwrites the old in place, with no blank flash between frames.
HOME = "\x1b[H"
_CLEAR_LINE = "\x1b[K"
_CLEAR_BELOW = "\x1b[J"
_ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, hide the cursor (like top, less)
_LEAVE = "\x1b[?25h\x1b[?1049l"


def render(status: FleetStatus) -> str:
    """The status as text: a title, one row per model and lane (summed over the model's
    partitions: ``PARTS`` is their count), then one row per worker."""
    when = datetime.fromtimestamp(status.now_ms / 1000, UTC).strftime("%H:%M:%S UTC")
    title = (f"redbatch  prefix {status.prefix}  {when}  "
             f"results, rates and latencies over the last {status.window_s:g} s")
    if not status.models:
        return f"{title}\n\nno models found: no job streams under prefix {status.prefix!r}\n"
    lanes = [row for model in status.models for row in _lane_rows(model)]
    workers = [_worker_row(model.model, w, status.now_ms)
               for model in status.models for w in model.workers]
    text = [title, "", *_table(LANE_COLUMNS, lanes), ""]
    text += _table(WORKER_COLUMNS, workers) if workers else ["no workers have sent a heartbeat"]
    return "\n".join(text) + "\n"


def _lane_rows(model: ModelStatus) -> list[list[str]]:
    alive = [w for w in model.workers if w.alive]
    beat = _age(max(w.heartbeat_age_s for w in alive)) if alive else "-"
    rows = []
    for i, lane in enumerate(model.lanes):
        # Dead letters, workers and partitions belong to the model: shown once, on its
        # first lane. Queue figures and dead letters are summed over its partitions.
        per_model = [str(model.dead_letters), str(len(alive)), beat, str(model.partitions)] \
            if i == 0 else ["", "", "", ""]
        rows.append([model.model if i == 0 else "", lane.lane, str(lane.length),
                     str(lane.pending), str(lane.lag), *per_model,
                     f"{lane.results_per_s:.1f}", _ms(lane.p50_ms), _ms(lane.p99_ms),
                     str(lane.errors)])
    return rows


def _worker_row(model: str, w: WorkerStatus, now_ms: int) -> list[str]:
    state = "alive" if w.alive else "gone"
    r = w.record
    if r is None:
        return [w.consumer, model, state, *["-"] * 5, _age(w.heartbeat_age_s), *["-"] * 3]
    return [w.consumer, model, state, r.host, str(r.pid), r.device, str(r.max_batch_size),
            str(r.inflight), _age(w.heartbeat_age_s), _age((now_ms - r.started_ms) / 1000),
            r.version, "-" if r.metrics_port is None else str(r.metrics_port)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _age(seconds: float) -> str:
    """Short and readable: 0.8s, 42s, 7m05s, 3h12m."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def _table(columns: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) if col in _LEFT else cell.rjust(w)
                         for cell, w, col in zip(cells, widths, columns, strict=True)).rstrip()

    return [line(columns), *(line(row) for row in rows)]


def run_top(frame: Callable[[], str], interval_s: float, out: TextIO) -> None:
    """Draw ``frame()`` every ``interval_s`` until Ctrl-C (KeyboardInterrupt), then return.

    On a terminal it redraws in place on the alternate screen, so the shell's screen comes
    back on exit. Anywhere else (a pipe, a file) it writes plain snapshots, each followed
    by a blank line, with no terminal codes (as ``top -b`` does).
    """
    tty = out.isatty()
    if tty:
        out.write(_ENTER)
    try:
        while True:
            started = time.monotonic()
            _draw(frame(), out, tty)
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        if tty:
            out.write(_LEAVE)
            out.flush()


def _draw(text: str, out: TextIO, tty: bool) -> None:
    lines = text.rstrip("\n").split("\n")
    if not tty:
        out.write("\n".join(lines) + "\n\n")
        out.flush()
        return
    # A wrapped line would push the frame down and break the in-place redraw.
    size = shutil.get_terminal_size()
    lines = [line[:size.columns] for line in lines[:size.lines - 1]]
    out.write(HOME + "".join(line + _CLEAR_LINE + "\n" for line in lines) + _CLEAR_BELOW)
    out.flush()
