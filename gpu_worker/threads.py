"""The worker's helper threads: each does I/O or compute and hands the main loop events.

The reader takes jobs from Redis (gpu_worker/streams/intake.py) into free in-flight places; the
model thread submits batches to the runner and the collect thread waits for their outputs
(NOTE [ Device path ] in device/runner.py); the writer writes answers and acknowledges their jobs
(results.py), so that a slow Redis never stalls the main loop's batching. None of them
touches the main loop's state: they talk to it through its event queue (NOTE [ Worker
threads ] in loop.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redbatch.common.redis_io import (
    REDIS_ERRORS,
    Backoff,
    RedisRefused,
    RedisUnavailable,
    error_code,
)
from redbatch.gpu_worker.batching.capacity import Capacity
from redbatch.gpu_worker.device.runner import DeviceFailure, ModelRunner
from redbatch.gpu_worker.events import DeviceLost, Event, Idle, Launch, Ran, Read, Written
from redbatch.gpu_worker.metrics import Health, WorkerMetrics
from redbatch.gpu_worker.streams.intake import Intake, Job
from redbatch.gpu_worker.streams.reclaim import Reclaimer
from redbatch.gpu_worker.streams.results import Answer, ResultWriter

logger = logging.getLogger(__name__)

#: How long the reader waits for a bulk place to come free before it blocks on the
#: interactive stream alone, s. Places come free with each write of answers, so while bulk
#: work flows this ends at the next write and the reader never sleeps on Redis with bulk
#: places idle (with 2 ms, bulk scored at 0.55-0.65x the interactive rate here; with 10,
#: at parity). The price: while bulk fills the worker and no place frees (a slow model),
#: an interactive job arriving now is read up to this much later.
BULK_ROOM_WAIT_S = 0.010


class Reader:
    """Reads as many jobs as there are free in-flight places of model ``model`` (its index
    among the worker's models), until stopped; Redis errors are retried with back-off, one
    line each, and never end the thread."""

    def __init__(self, intake: Intake, capacity: Capacity, metrics: WorkerMetrics,
                 health: Health, put: Callable[[Event], None], model: int = 0) -> None:
        self.model = model
        self.intake = intake
        self.capacity = capacity
        self.metrics = metrics
        self.health = health
        self.put = put
        self._backoff = Backoff()

    def run(self, stop: threading.Event, max_inflight: int, block_ms: int,
            idle_wait_s: float) -> None:
        while not stop.is_set():
            # Bulk at its bound: its places come free with answers, not with anything
            # arriving in Redis, so wait for one briefly here before a read that would
            # block on the interactive stream alone (Intake._read_new).
            if self.capacity.bulk_room() == 0:
                self.capacity.wait_for_bulk_room(BULK_ROOM_WAIT_S)
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
            if self.model:
                for job in jobs:
                    job.model = self.model
            self.put(Read(jobs, bad, self.model))
        elif not self.intake.recovering:
            self.put(Idle(self.model))
        return True


def submit_batches(runners: Sequence[ModelRunner], reclaimers: Sequence[Reclaimer],
                   batches: queue.SimpleQueue[Launch | None],
                   collecting: queue.SimpleQueue[Any]) -> None:
    """Model thread: submit each batch to its model's runner (on CUDA this returns before
    it has run), until None. A taken-over job has its delivery counted first (an XCLAIM,
    here and not on the main loop, so a slow Redis never stalls batching; NOTE [ Poison
    jobs ] in reclaim.py)."""
    while (item := batches.get()) is not None:
        model, batch, waits, size, suspect = item
        if suspect:
            count_delivery(reclaimers[model], batch[0])
        job = runners[model].submit([j.slot for j in batch],
                                    [j.envelope.params for j in batch], size)
        collecting.put((model, batch, waits, job))
    collecting.put(None)


def count_delivery(reclaimer: Reclaimer, job: Job) -> None:
    """Charge a taken-over job one delivery before it runs. When Redis cannot count it
    (unreachable, refusing, the group gone with a Redis restarted empty) it runs uncounted
    this once; the lease and the next takeover still bound it."""
    try:
        reclaimer.charge(job.stream, job.entry_id)
    except redis.RedisError as e:
        logger.warning("could not count a delivery of taken-over job %s (%s); running "
                       "it anyway", job.request_id, e)


def collect_batches(runners: Sequence[ModelRunner], collecting: queue.SimpleQueue[Any],
                    put: Callable[[Event], None]) -> None:
    """Collect thread: wait for each submitted batch in order, postprocess, hand the
    outcomes over; a device failure is handed over and ends the thread."""
    while (item := collecting.get()) is not None:
        model, batch, waits, job = item
        try:
            outcomes = runners[model].collect(job)
        except DeviceFailure as e:
            put(DeviceLost(str(e)))
            return
        put(Ran(batch, outcomes, job.run_s * 1000, waits, job.size, model,
                job.compute_s * 1000))


def write_answers(writer: ResultWriter, outgoing: queue.SimpleQueue[list[Answer] | None],
                  put: Callable[[Event], None], model: int = 0) -> None:
    """Writer thread of model ``model``: write each group of its answers with their
    acknowledgements and hand the outcome back as a Written event, until None. A failed
    write is handed back whole (the main loop retries it); nothing here ends the thread."""
    while (answers := outgoing.get()) is not None:
        try:
            put(Written(answers, writer.write_and_ack(answers), model=model))
        except (RedisUnavailable, RedisRefused) as e:
            put(Written(answers, error=e, model=model))
        except Exception as e:  # a bug must not leave answers unwritten for good
            logger.exception("writing %d answers failed", len(answers))
            put(Written(answers, error=RedisUnavailable(f"writing failed: {e!r}"),
                        model=model))
