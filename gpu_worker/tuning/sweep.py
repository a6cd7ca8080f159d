"""Timing a model on its device: every variant, batch sizes 1, 2, 4, ... up to a cap.

The runs go through the worker's own device path (ModelRunner: gather from a slot
array, copy, forward, copy back, postprocess), without Redis or a pool, in two
passes. The first scouts sizes in ascending order; at each, the variants are timed
run by run in turn, so a noisy neighbour slows all of them alike and the comparison
between variants holds. A variant's sweep stops early when its throughput has
clearly fallen, has stopped growing, its p95 latency is over a budget given in ms,
or (CUDA) the next size would eat into the free-memory watermark.

The second times the kept sizes again in rounds (in_rounds), so that the comparison
between sizes holds too: sizes timed one after another differed by up to 48% at one
size between calibrations here, as the machine's speed drifted over the minutes of a
sweep. Each visit is a block, one untimed run then a few timed: single runs of each
size in turn ran from cold caches (the compiled batch of 1 took 29 ms, not 14).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from redbatch.common.config import Budget
from redbatch.gpu_worker.device.runner import ModelRunner
from redbatch.gpu_worker.device.watchdog import Watch, unwatched
from redbatch.gpu_worker.tuning.profile import Measured, Row, Variant
from redbatch.gpu_worker.tuning.variants import Model
from redbatch.handlers.base import Handler

if TYPE_CHECKING:
    from redbatch.gpu_worker.tuning.calibrate import CalibrationSettings

logger = logging.getLogger(__name__)

#: A sweep stops once throughput is below this share of its best so far at two sizes in a
#: row (one slow size may be a noisy neighbour), or below CLEARLY_FALLEN at one.
FALLEN_SHARE = 0.8
CLEARLY_FALLEN = 0.6
#: ... or when three doublings in a row gained less than this factor each (on CPU the
#: throughput may stay flat from 2 to 8 and still gain 10% by 16).
PLATEAU_GAIN = 1.02
#: Timed runs per size while scouting, when the sizes are timed again in rounds after.
SCOUT_RUNS = 3
#: Timed runs per size in each round.
ROUND_RUNS = 2


def batch_sizes(cap: int) -> list[int]:
    """1, 2, 4, ... up to ``cap``, and ``cap`` itself."""
    sizes = [1 << i for i in range(cap.bit_length()) if 1 << i <= cap]
    return sizes if sizes[-1] == cap else [*sizes, cap]


def between_sizes(max_batch: int) -> list[int]:
    """The size just below each power of two from 4 up to ``max_batch`` (3, 7, 15, ...):
    where a rounded-up batch (8 against 7) may be faster on some devices."""
    return [s - 1 for s in batch_sizes(max_batch) if s >= 4 and s & (s - 1) == 0]


def _slot_array(cap: int, handler: Handler) -> np.ndarray:
    """Inputs in a plain array shaped like the worker's shared-memory slots."""
    shape = (cap, *handler.input_shape)
    if np.issubdtype(np.dtype(handler.input_dtype), np.floating):
        rng = np.random.default_rng(0)
        return rng.standard_normal(shape, dtype=np.float32).astype(handler.input_dtype)
    return np.zeros(shape, dtype=handler.input_dtype)  # any index or pixel value is valid


class _Sweep:
    """Runners of every variant over one slot array, timed run by run in turn; each run
    inside ``watch`` (NOTE [ Device watchdog ])."""

    def __init__(self, handler: Handler, model: Model, device: torch.device,
                 variants: Sequence[Variant], cap: int, settings: CalibrationSettings,
                 watch: Watch = unwatched) -> None:
        self.device = device
        self.settings = settings
        self.watch = watch
        self.slots = _slot_array(cap, handler)
        copies: dict[bool, Model] = {False: model}
        if any(v.channels_last for v in variants):
            # Interleaving needs both memory formats at once: a second copy of the weights.
            copies[True] = model if all(v.channels_last for v in variants) \
                else copy.deepcopy(model)
        self.runners: dict[Variant, ModelRunner] = {}
        for v in variants:
            shared = next(iter(self.runners.values()))._host if self.runners else None
            self.runners[v] = ModelRunner(handler, device, self.slots, cap, v,
                                          model=copies[v.channels_last],
                                          memory_watermark=settings.memory_watermark,
                                          host_buffers=shared, lanes=settings.lanes)
        self.at_once = self.runners[variants[0]].depth if device.type == "cpu" else 1
        self.wall_s = 0.0
        self.cpu_s = 0.0

    @property
    def cpu_share(self) -> float | None:
        """CPU: the share of its threads' time the timed runs got (1.0 on a quiet machine;
        less when other processes took cores). None on CUDA."""
        if self.device.type != "cpu" or self.wall_s == 0:
            return None
        return self.cpu_s / (self.wall_s * torch.get_num_threads() * self.at_once)

    def time_size(self, size: int, active: list[Variant], runs: int | None = None,
                  warmup_runs: int | None = None) -> dict[Variant, Row | str]:
        """A Row per variant, or the reason it cannot run this size (out of memory)."""
        ids = list(range(size))
        params: list[dict[str, object]] = [{}] * size
        failed: dict[Variant, Row | str] = {}
        for v in active:
            for _ in range(self.settings.warmup_runs if warmup_runs is None else warmup_runs):
                self._run(v, ids, params, failed)
        times: dict[Variant, list[float]] = {v: [] for v in active}
        peaks: dict[Variant, int] = {}
        for _ in range(self.settings.runs if runs is None else runs):
            for v in (v for v in active if v not in failed):
                base = self._reset_peak()
                start, cpu = time.perf_counter(), time.process_time()
                self._run(v, ids, params, failed)
                times[v].append(time.perf_counter() - start)
                self.wall_s += times[v][-1]
                self.cpu_s += time.process_time() - cpu
                peaks[v] = max(peaks.get(v, 0), self._peak() - base)
        for v in (v for v in active if v not in failed):
            ms = np.asarray(times[v]) * 1000
            failed[v] = Row(size, float(np.median(ms)), float(np.percentile(ms, 95)),
                            len(ms), peaks[v] if self.device.type == "cuda" else None,
                            self.at_once)
        return failed

    def outputs(self, variants: Sequence[Variant], size: int,
                inputs: np.ndarray | None = None) -> dict[Variant, torch.Tensor]:
        """Each variant's output rows (float32, one row per input, flattened) for
        ``inputs`` (default: the ``size`` random rows already in the slots), run in
        batches of ``size``, a size every variant ran (a compiled one has a graph for
        it). Variants whose outputs are not tensors, or that fail, are left out."""
        chunks = [None] if inputs is None else range(0, len(inputs), size)
        rows: dict[Variant, list[torch.Tensor]] = {v: [] for v in variants}
        for start in chunks:
            n = size
            if inputs is not None and start is not None:
                chunk = inputs[start:start + size]
                n = len(chunk)
                self.slots[:n] = chunk
                self.slots[n:size] = chunk[-1]  # a full batch: the compiled shape
            for v in [v for v in variants if v in rows]:
                try:
                    with self.watch(f"calibration, checking {v.name}'s answers at batch {size}"):
                        job = self.runners[v].submit(list(range(size)), [{}] * size)
                        self.runners[v].finish(job)
                    out = job.outputs
                except Exception:  # noqa: BLE001 - its timing rows already say it failed
                    out = None
                if isinstance(out, torch.Tensor):
                    rows[v].append(out[:n].detach().float().cpu().reshape(n, -1))
                else:
                    del rows[v]
        return {v: torch.cat(parts) for v, parts in rows.items() if parts}


    def _run(self, v: Variant, ids: list[int], params: list[dict[str, object]],
             failed: dict[Variant, Row | str]) -> None:
        if v in failed:
            return
        runner = self.runners[v]
        try:
            # As many batches at once as the worker runs (CPU lanes), each waited for.
            with self.watch(f"calibration, {v.name} at batch {len(ids)}"):
                jobs = [runner.submit(ids, params) for _ in range(self.at_once)]
                for job in jobs:
                    runner.finish(job)
        except torch.cuda.OutOfMemoryError:
            failed[v] = f"out of memory at batch {len(ids)}"
            torch.cuda.empty_cache()

    def _reset_peak(self) -> int:
        """Bytes allocated now (weights, buffers), from which a run's peak is measured."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def _peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device)) \
            if self.device.type == "cuda" else 0

    def memory_stop(self, rows: Sequence[Row], next_size: int) -> str:
        """CUDA: why ``next_size`` must not be tried (it would pass the watermark), or ''."""
        if self.device.type != "cuda" or not rows or rows[-1].peak_memory_bytes is None:
            return ""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        last, peak = rows[-1], rows[-1].peak_memory_bytes
        more = peak * (next_size / last.batch_size - 1)
        if free + cached - more < self.settings.memory_watermark * total:
            return (f"batch {next_size} would leave less than {self.settings.memory_watermark:.0%}"
                    " of device memory free")
        return ""


def stop_reason(rows: Sequence[Row], latency_budget_ms: Budget) -> str:
    """Why a sweep should not try a larger size, from its rows so far (ascending), or ''.
    The default budget ("auto") is only known from the whole table: it never stops one."""
    last = rows[-1]
    best = max(r.images_per_s for r in rows)
    fallen = len(rows) >= 3 and all(r.images_per_s < FALLEN_SHARE * best for r in rows[-2:])
    if fallen or last.images_per_s < CLEARLY_FALLEN * best:
        return f"throughput fell to {last.images_per_s / best:.0%} of its best"
    if isinstance(latency_budget_ms, (int, float)) and last.p95_ms > latency_budget_ms:
        return f"p95 {last.p95_ms:.1f} ms over the {latency_budget_ms:g} ms budget"
    if len(rows) >= 4 and all(rows[i].images_per_s < PLATEAU_GAIN * rows[i - 1].images_per_s
                              for i in (-1, -2, -3)):
        return "throughput stopped growing"
    return ""


def sweep(handler: Handler, model: Model, device: torch.device, variants: Sequence[Variant],
          cap: int, settings: CalibrationSettings,
          report: Callable[[str], None] = logger.info,
          watch: Watch = unwatched) -> tuple[list[Measured], _Sweep]:
    """Measure every variant for sizes 1, 2, 4, ... up to ``cap``: scout the sizes in
    order (variants interleaved), then time the kept ones again in rounds; every run
    inside ``watch``."""
    runs = _Sweep(handler, model, device, variants, cap, settings, watch)
    scout = min(SCOUT_RUNS, settings.runs) if settings.rounds > 1 else settings.runs
    rows: dict[Variant, list[Row]] = {v: [] for v in variants}
    stopped: dict[Variant, str] = {}
    for size in batch_sizes(cap):
        active = [v for v in variants if v not in stopped]
        for v in active:
            if why := runs.memory_stop(rows[v], size):
                stopped[v] = why
        active = [v for v in active if v not in stopped]
        if not active:
            break
        for v, got in runs.time_size(size, active, scout).items():
            if isinstance(got, str):
                stopped[v] = got
                continue
            rows[v].append(got)
            report(f"  {v.name:<26} batch {size:4d}: {got.median_ms:9.1f} ms  "
                   f"{got.images_per_s:8.1f} img/s")
            if why := stop_reason(rows[v], settings.latency_budget_ms):
                stopped[v] = why
    if settings.rounds > 1:
        report(f"timing the sizes kept again: {settings.rounds} rounds over all of them")
        rows = in_rounds(runs, rows, settings.rounds)
    return [Measured(v, tuple(rows[v]), stopped.get(v, f"cap {cap}")) for v in variants], runs


def in_rounds(runs: _Sweep, rows: dict[Variant, list[Row]], rounds: int
              ) -> dict[Variant, list[Row]]:
    """Every (variant, size) of ``rows`` timed again in ``rounds`` rounds over all the
    sizes, a block at each (one untimed run, warming the caches, then ROUND_RUNS timed):
    the rows with the median of the rounds' medians and the largest p95. A slow minute
    then lands in one round of every size rather than in all runs of one."""
    got: dict[tuple[Variant, int], list[Row]] = {}
    sizes = sorted({r.batch_size for kept in rows.values() for r in kept})
    for _ in range(rounds):
        for size in sizes:
            active = [v for v, kept in rows.items() if any(r.batch_size == size for r in kept)]
            for v, row in runs.time_size(size, active, ROUND_RUNS, warmup_runs=1).items():
                if isinstance(row, Row):
                    got.setdefault((v, size), []).append(row)
    return {v: [dataclasses.replace(
                r, median_ms=float(np.median([x.median_ms for x in again])),
                p95_ms=max(x.p95_ms for x in again), runs=sum(x.runs for x in again))
                if (again := got.get((v, r.batch_size))) else r for r in kept]
            for v, kept in rows.items()}
