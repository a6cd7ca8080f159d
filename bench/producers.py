"""Producer processes for the end-to-end benches, with counters they share with the bench.

Each process is spawned (it builds its own client: nothing crosses a fork) and runs
``produce(*args, counts, stop)``: it keeps its jobs in flight until ``stop`` is set, then
waits for what it has in flight. ``counts[2 * i]`` counts the jobs process ``i`` saw
answered and ``counts[2 * i + 1]`` the failed ones; only process ``i`` writes them.
bench/ceiling.py and bench/gpu_e2e.py use it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

import psutil


@dataclass(slots=True)
class Producers:
    """The producer processes and their shared counters."""

    procs: list[BaseProcess]
    counts: ctypes.Array[ctypes.c_longlong]
    stop: Event

    @classmethod
    def start(cls, produce: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> Producers:
        """One process per entry of ``args``: process ``i`` runs
        ``produce(*args[i], counts, stop)``."""
        ctx = mp.get_context("spawn")
        counts = ctx.RawArray(ctypes.c_longlong, 2 * len(args))
        stop = ctx.Event()
        procs: list[BaseProcess] = [
            ctx.Process(target=produce, args=(*each, counts, stop), name=f"producer-{i}",
                        daemon=True) for i, each in enumerate(args)]
        for p in procs:
            p.start()
        return cls(procs, counts, stop)

    def answered(self) -> tuple[int, int]:
        """Jobs answered so far, and of them failed."""
        values = list(self.counts)
        return sum(values[0::2]), sum(values[1::2])

    def psutil_procs(self) -> list[psutil.Process]:
        return [psutil.Process(p.pid) for p in self.procs if p.pid is not None]

    def close(self, drain_s: float) -> None:
        """Stop them once their jobs are answered (each waits up to ``drain_s``); say so
        when one failed."""
        self.stop.set()
        for p in self.procs:
            p.join(drain_s + 10)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.exitcode != 0:
                print(f"WARNING: {p.name} exited with code {p.exitcode} (its traceback is "
                      "above); the figures count only what it answered before")


def shares(window: int, n: int) -> list[int]:
    """``window`` jobs in flight split over ``n`` producers, as evenly as they go."""
    return [window // n + (i < window % n) for i in range(n)]
