"""One load generator for every system: closed-loop clients, or open-loop Poisson arrivals.

A system is driven through a *caller factory*: ``make_caller()`` returns a function that
sends one photo, waits for its answer, and raises if the answer is an error. Each client
thread makes its own caller (its own connection), so no client object is shared between
threads, whatever the system's thread-safety.

Latency is measured on the client, from the request's start (closed loop) or its scheduled
arrival (open loop, so time spent waiting for a free client thread counts too) to the end.
"""

from __future__ import annotations

import itertools
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Caller = Callable[[bytes], object]
CallerFactory = Callable[[], Caller]


@dataclass
class Run:
    """What one measured phase produced."""

    mode: str  # "closed" or "open"
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)
    #: Answers that arrived during the steady phase (whenever their request was sent).
    completed: int = 0
    errors: int = 0
    #: Open loop: requests still unanswered when the drain ended (counted in the latencies).
    unfinished: int = 0
    offered_per_s: float = 0.0
    clients: int = 0
    first_error: str = ""

    @property
    def throughput(self) -> float:
        """Answers per second during the steady phase."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else math.nan


class _Recorder:
    """Collects outcomes from many threads; only those inside [start, end) count."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.samples: list[tuple[float, float]] = []  # (reference time, latency s)
        self.errors: list[tuple[float, str]] = []

    def ok(self, ref: float, latency_s: float) -> None:
        with self.lock:
            self.samples.append((ref, latency_s))

    def error(self, ref: float, e: BaseException) -> None:
        with self.lock:
            self.errors.append((ref, f"{type(e).__name__}: {e}"[:300]))

    def window(self, start: float, end: float, by_end: bool) -> tuple[list[float], list[str]]:
        """Latencies (ms) and errors of requests that ended (closed loop) or arrived
        (open loop) inside the window."""
        with self.lock:
            lat = [lat_s * 1000 for ref, lat_s in self.samples
                   if start <= (ref + lat_s if by_end else ref) < end]
            errs = [msg for ref, msg in self.errors if start <= ref < end]
        return lat, errs

    def ended(self, start: float, end: float) -> int:
        """Successful answers that came back inside the window."""
        with self.lock:
            return sum(1 for ref, lat_s in self.samples if start <= ref + lat_s < end)


def _photo_cycle(payloads: list[bytes], offset: int) -> itertools.cycle[bytes]:
    return itertools.cycle(payloads[offset % len(payloads):] + payloads[:offset % len(payloads)])


def closed_loop(make_caller: CallerFactory, payloads: list[bytes], clients: int,
                warmup_s: float, steady_s: float, timeout_s: float = 60.0) -> Run:
    """``clients`` threads each send a photo and wait for it, back to back, for warm-up then
    steady phase; throughput and latencies come from requests that ended in the steady phase."""
    rec = _Recorder()
    callers = [make_caller() for _ in range(clients)]  # connections set up before the clock
    start = time.perf_counter()
    steady_at, stop_at = start + warmup_s, start + warmup_s + steady_s

    def client(i: int) -> None:
        photos = _photo_cycle(payloads, i)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                callers[i](next(photos))
                rec.ok(t0, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
                rec.error(time.perf_counter(), e)
                time.sleep(0.05)  # a dead system must not become a busy loop

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, stop_at - time.perf_counter()) + timeout_s)
    lat, errs = rec.window(steady_at, stop_at, by_end=True)
    return Run("closed", steady_s, lat, len(lat), len(errs), clients=clients,
               first_error=errs[0] if errs else "")


def open_loop(make_caller: CallerFactory, payloads: list[bytes], rate: float, warmup_s: float,
              steady_s: float, threads: int = 128, drain_s: float = 15.0, seed: int = 0) -> Run:
    """Poisson arrivals at ``rate``/s for warm-up then steady phase, served by up to
    ``threads`` client threads (each makes its caller on first use). Requests that arrived in
    the steady phase count; those unanswered ``drain_s`` after the last arrival count with
    their age then, as a lower bound."""
    rec = _Recorder()
    arrivals: queue.Queue[float | None] = queue.Queue()
    outstanding: dict[int, float] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        call: Caller | None = None
        photos = _photo_cycle(payloads, i)
        while (at := arrivals.get()) is not None:
            with lock:
                outstanding[i] = at
            try:
                call = call or make_caller()
                call(next(photos))
                rec.ok(at, time.perf_counter() - at)
            except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
                rec.error(at, e)
            with lock:
                outstanding.pop(i, None)

    pool = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    rng = random.Random(seed)
    start = time.perf_counter()
    steady_at, stop_at = start + warmup_s, start + warmup_s + steady_s
    at = start
    while (at := at + rng.expovariate(rate)) < stop_at:
        time.sleep(max(0.0, at - time.perf_counter()))
        arrivals.put(at)
    for _ in pool:
        arrivals.put(None)
    deadline = time.perf_counter() + drain_s
    for t in pool:
        t.join(timeout=max(0.0, deadline - time.perf_counter()))
    lat, errs = rec.window(steady_at, stop_at, by_end=False)
    now = time.perf_counter()
    with lock:
        stuck = [now - a for a in outstanding.values() if steady_at <= a < stop_at]
    stuck_ms = [s * 1000 for s in stuck]
    # Arrivals still queued (no free thread before the drain ended) never started.
    queued = [(now - a) * 1000 for a in _drain(arrivals) if steady_at <= a < stop_at]
    unfinished = len(stuck_ms) + len(queued)
    return Run("open", steady_s, lat + stuck_ms + queued, rec.ended(steady_at, stop_at),
               len(errs), unfinished=unfinished, offered_per_s=rate, clients=threads,
               first_error=errs[0] if errs else "")


def _drain(q: queue.Queue[float | None]) -> list[float]:
    out: list[float] = []
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return out
        if item is not None:
            out.append(item)
