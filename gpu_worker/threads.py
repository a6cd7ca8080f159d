"""The worker's helper threads: each does I/O or compute and hands the main loop events.

The reader takes jobs from Redis (gpu_worker/intake.py) into free in-flight places; the
model thread submits batches to the runner and the collect thread waits for their outputs
(NOTE [ Device path ] in model.py). None of them touches the main loop's state: they talk to
it through its event queue (NOTE [ Worker threads ] in loop.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import redis
from redbatch.common.redis_io import REDIS_ERRORS, Backoff, error_code
from redbatch.gpu_worker.capacity import Capacity
from redbatch.gpu_worker.events import DeviceLost, Event, Idle, Ran, Read
from redbatch.gpu_worker.intake import Intake, Job
from redbatch.gpu_worker.metrics import Health, WorkerMetrics
from redbatch.gpu_worker.model import DeviceFailure, ModelRunner

logger = logging.getLogger(__name__)

#: A batch for the model thread: its jobs, their batch-wait times (ms), the size to run at.
Launch = tuple[list[Job], list[float], int]


class Reader:
    """Reads as many jobs as there are free in-flight places, until stopped; Redis errors
    are retried with back-off, one line each, and never end the thread."""

    def __init__(self, intake: Intake, capacity: Capacity, metrics: WorkerMetrics,
                 health: Health, put: Callable[[Event], None]) -> None:
        self.intake = intake
        self.capacity = capacity
        self.metrics = metrics
        self.health = health
        self.put = put
        self._backoff = Backoff()

    def run(self, stop: threading.Event, max_inflight: int, block_ms: int,
            idle_wait_s: float) -> None:
        while not stop.is_set():
            n = self.capacity.take_up_to(max_inflight, timeout_s=idle_wait_s)
            if n and not self._read(n, block_ms):
                self.capacity.give_back(n)
                stop.wait(self._backoff.next_wait_s())

    def _read(self, n: int, block_ms: int) -> bool:
        """One read into ``n`` places; False when it failed (the places are still taken)."""
        try:
            jobs, bad = self.intake.read(n, min(n, self.capacity.bulk_room()), block_ms)
        except REDIS_ERRORS as e:
            logger.warning("reading jobs failed: %s; retrying", e)
            return False
        except redis.ResponseError as e:  # a replica, a stream replaced by another type
            self.health.refused("reads", f"{error_code(e)}: {e}")
            logger.warning("Redis refused reading jobs (%s); retrying", e)
            return False
        except Exception:  # a bug here must not silently stop the worker from reading
            logger.exception("reading jobs failed; retrying")
            return False
        self._backoff.reset()
        self.health.accepted("reads")
        self.metrics.reclaimed(sum(job.taken_over for job in jobs))
        self.capacity.took_bulk(sum(job.bulk for job in jobs))
        self.capacity.give_back(n - len(jobs) - len(bad))
        if jobs or bad:
            self.put(Read(jobs, bad))
        elif not self.intake.recovering:
            self.put(Idle())
        return True


def submit_batches(runner: ModelRunner, batches: queue.SimpleQueue[Launch | None],
                   collecting: queue.SimpleQueue[Any]) -> None:
    """Model thread: submit each batch (on CUDA this returns before it has run), until None."""
    while (item := batches.get()) is not None:
        batch, waits, size = item
        job = runner.submit([j.slot for j in batch], [j.envelope.params for j in batch], size)
        collecting.put((batch, waits, job))
    collecting.put(None)


def collect_batches(runner: ModelRunner, collecting: queue.SimpleQueue[Any],
                    put: Callable[[Event], None]) -> None:
    """Collect thread: wait for each submitted batch in order, postprocess, hand the
    outcomes over; a device failure is handed over and ends the thread."""
    while (item := collecting.get()) is not None:
        batch, waits, job = item
        try:
            outcomes = runner.collect(job)
        except DeviceFailure as e:
            put(DeviceLost(str(e)))
            return
        put(Ran(batch, outcomes, job.run_s * 1000, waits, job.size))
