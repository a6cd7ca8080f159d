"""The worker: one main loop owns every piece of state; helper threads only do I/O or compute.

NOTE [ Worker threads ]

    Redis streams --XREADGROUP--> [intake thread] --_Read-------+
    pool processes --records----> [pump thread]   --PreprocDone-+--> events --> [main loop]
    (shared-memory slots)         [model thread]  --_Ran--------+                   |
                                        ^                                           |
                                        +------------- batch of slot ids -----------+
    main loop: pool.submit -> batcher.add -> batcher.pop_ready -> model thread
               -> ResultWriter.write_and_ack (SET result, RPUSH done, XACK, XDEL)

  Only the main loop touches the batcher, the slot allocator, the pool's
  bookkeeping and the answers; the threads hand it events through one queue,
  so there are no locks around state. The model thread runs one batch at a
  time; while it runs, the main loop keeps reading and the next batch grows.

NOTE [ Worker shutdown ]
  1. First SIGTERM/SIGINT (``stop``): intake stops reading; the main loop
     finishes what is in flight, writes and acknowledges, for at most
     ``shutdown_grace_s``; then teardown.
  2. Second signal (``abort``): the main loop leaves at once. Jobs read but
     not answered stay pending in Redis: nothing is acknowledged without its
     result, so they are served again.
  3. Teardown, on every exit path (``finally``): stop the threads, stop the
     pool processes, unlink the shared-memory segment.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from redbatch.common import malloc_tuning
from redbatch.common.config import Settings
from redbatch.common.protocol import ErrorCode, Keys, Lane
from redbatch.common.redis_io import REDIS_ERRORS, Backoff, RedisUnavailable, connect
from redbatch.gpu_worker.batcher import Batcher, LanePolicy, LatencyEstimator
from redbatch.gpu_worker.capacity import Capacity
from redbatch.gpu_worker.handlers import Handler, load_handler
from redbatch.gpu_worker.intake import BadEntry, Intake, Job
from redbatch.gpu_worker.model import DeviceFailure, Outcome
from redbatch.gpu_worker.results import Answer, ResultWriter
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotAllocator, SlotArray
from redbatch.preproc_worker.worker import PreprocDone

logger = logging.getLogger(__name__)

#: Longest the main loop sleeps without an event, seconds (bounds reaping and shutdown checks).
MAX_IDLE_WAIT_S = 0.2


@dataclass(frozen=True, slots=True)
class _Read:
    jobs: list[Job]
    bad: list[BadEntry]


@dataclass(frozen=True, slots=True)
class _Ran:
    batch: list[Job]
    outcomes: list[Outcome]
    inference_ms: float
    batch_wait_ms: list[float]


@dataclass(frozen=True, slots=True)
class _DeviceLost:
    message: str


class _Idle:
    """Intake found the streams empty (used by burst mode)."""


class Worker:
    """Serves one model from its Redis streams until stopped (or drained, in burst mode)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.model.served_name, settings.redis.prefix)
        self.batch_sizes: Counter[int] = Counter()
        self._events: queue.Queue[Any] = queue.Queue()
        # Unbounded, but the main loop launches one batch at a time (_model_busy).
        self._batches: queue.SimpleQueue[tuple[list[Job], list[float]] | None] = \
            queue.SimpleQueue()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._ready = threading.Event()
        self._answers: list[Answer] = []
        self._pending: dict[int, Job] = {}  # pool task key -> job
        self._suspects: deque[Job] = deque()  # jobs delivered before: each runs alone
        self._model_busy = False
        self._retry_at = 0.0
        self._write_backoff = Backoff()
        self._stop_deadline: float | None = None
        #: Set when the device broke; the worker command then exits non-zero.
        self.device_failed = False
        self._threads: list[threading.Thread] = []
        b = settings.batch
        # Bulk jobs never take the in-flight places kept for interactive ones.
        self.capacity = Capacity(b.max_inflight, b.max_inflight - b.interactive_reserve)
        self.latency = LatencyEstimator()
        lanes = LanePolicy(bulk_max_wait_s=b.bulk_max_wait_ms / 1000, bulk_share=b.bulk_share,
                           bulk_starve_s=b.bulk_starve_ms / 1000,
                           bulk_batch_budget_s=b.bulk_batch_ms / 1000 if b.bulk_batch_ms else None)
        self.batcher: Batcher[Job] = Batcher(b.max_batch_size, b.max_wait_ms / 1000,
                                             self.latency, lanes)
        self.pool: PreprocPool | None = None
        self.slots: SlotArray | None = None
        self.runner: Any = None

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Graceful: stop reading, finish in-flight work, exit. Safe from a signal handler."""
        self._stop.set()

    def abort(self) -> None:
        """Leave at once; unanswered jobs stay pending in Redis."""
        self._stop.set()
        self._abort.set()

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Set up, loop until stopped, and always tear down."""
        try:
            self.setup()
            while not self._finished():
                self.step()
        finally:
            self.teardown()

    def setup(self) -> None:
        """Pool first (its processes start while the model loads), then model, then Redis."""
        s = self.settings
        logger.info("starting worker %s for model %s: %r", s.consumer, self.keys.model, s)
        handler = load_handler(s.model.spec, s.limits)
        self._start_pool(handler)
        self._load_model(handler)
        self.intake = Intake(connect(s.redis), self.keys, s.consumer, s.limits.max_payload_bytes,
                             s.reclaim_idle_ms, s.max_deliveries)
        self._wait_for_redis()
        self.writer = ResultWriter(connect(s.redis), self.keys, s.consumer, s.result_ttl_s)
        self._start_threads()
        self._ready.set()

    def _wait_for_redis(self) -> None:
        """Create the consumer groups, waiting out a Redis that is down (no crash loop)."""
        backoff = Backoff()
        while True:
            try:
                self.intake.ensure_groups()
                return
            except REDIS_ERRORS as e:
                wait = backoff.next_wait_s()
                logger.warning("Redis not reachable (%s); retrying in %.1fs", e, wait)
                if self._stop.wait(wait):
                    raise RedisUnavailable("stopped while waiting for Redis") from e

    def _start_pool(self, handler: Handler) -> None:
        s = self.settings
        self.slots = SlotArray.create(s.batch.max_inflight, handler.input_shape,
                                      handler.input_dtype)
        self.allocator = SlotAllocator(s.batch.max_inflight)
        self.pool = PreprocPool(s.model.spec, s.limits, s.pool, self.slots.layout)
        self.pool.start(on_done=self._events.put)

    def _load_model(self, handler: Handler) -> None:
        import torch
        from redbatch.gpu_worker.model import ModelRunner, choose_torch_threads, resolve_device

        s = self.settings
        assert self.slots is not None
        torch.set_num_threads(choose_torch_threads(s.model.torch_threads, s.pool.processes))
        device = resolve_device(s.model.device)
        self.runner = ModelRunner(handler, device, self.slots.array, s.batch.max_batch_size)
        for size, seconds in self.runner.warmup([1, s.batch.max_batch_size]).items():
            self.latency.observe(size, seconds)
        logger.info("model ready: device=%s torch_threads=%d pool=%d max_batch=%d "
                    "max_wait_ms=%g", device, torch.get_num_threads(), s.pool.processes,
                    s.batch.max_batch_size, s.batch.max_wait_ms)
        if device.type == "cpu":
            logger.info("%s", malloc_tuning.describe())

    def _start_threads(self) -> None:
        for name, target in (("intake", self._intake_loop), ("model", self._model_loop)):
            thread = threading.Thread(target=target, name=f"redbatch-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def teardown(self) -> None:
        self._stop.set()
        if self._threads:
            self._batches.put(None)
            for thread in self._threads:
                thread.join(timeout=0 if self._abort.is_set() else 10)
        if self.pool is not None:
            self.pool.close()
        if self.runner is not None:
            self.runner.close()
        if self.slots is not None:
            self.slots.close()
        if self.batch_sizes:
            logger.info("batch sizes: %s", dict(sorted(self.batch_sizes.items())))
        logger.info("worker %s stopped", self.settings.consumer)

    def _finished(self) -> bool:
        if self._abort.is_set():
            return True
        if not self._stop.is_set():
            return False
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.settings.shutdown_grace_s
        drained = self.capacity.in_use == 0
        if not drained and time.monotonic() > self._stop_deadline:
            logger.warning("shutdown grace over; %d jobs stay pending", self.capacity.in_use)
            return True
        return drained

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        """Handle what arrived, answer expired jobs, launch a batch if due, write answers."""
        self._handle_events(self._wait_s(time.monotonic()))
        assert self.pool is not None
        for record in self.pool.reap():
            self._finish_preprocessing(record)
        now = time.monotonic()
        for job in self.batcher.pop_expired(now):
            self._answers.append(self.writer.failed(job, ErrorCode.EXPIRED, "deadline passed "
                                                    "before the job could run"))
        if not self._model_busy:
            self._launch(self._next_suspect() or self.batcher.pop_ready(now), now)
        self._flush()

    def _next_suspect(self) -> list[Job]:
        if not self._suspects:
            return []
        job = self._suspects.popleft()
        try:
            self.intake.reclaimer.charge(job.stream, job.entry_id)
        except REDIS_ERRORS:
            pass  # uncounted this once; the lease and the next takeover still bound it
        return [job]

    def _wait_s(self, now: float) -> float:
        if self._suspects and not self._model_busy:
            return 0.0
        if self._answers:
            return max(0.0, min(self._retry_at - now, MAX_IDLE_WAIT_S))
        wake = self.batcher.next_wakeup(now)
        if wake is None or self._model_busy:
            return MAX_IDLE_WAIT_S
        return max(0.0, min(wake - now, MAX_IDLE_WAIT_S))

    def _handle_events(self, timeout_s: float) -> None:
        try:
            event = self._events.get(timeout=timeout_s) if timeout_s > 0 else \
                self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, event: Any) -> None:
        if isinstance(event, PreprocDone):
            self._on_preprocessed(event)
        elif isinstance(event, _Read):
            self._on_read(event)
        elif isinstance(event, _Ran):
            self._on_ran(event)
        elif isinstance(event, _DeviceLost):
            logger.critical("device failure, exiting for a restart (jobs in flight stay "
                            "pending and are taken over): %s", event.message)
            self.device_failed = True
            self.abort()
        elif isinstance(event, _Idle) and self.settings.burst and self.capacity.in_use == 0:
            logger.info("burst mode: streams drained, stopping")
            self.stop()

    def _on_read(self, event: _Read) -> None:
        assert self.pool is not None
        self._answers += [self.writer.rejected(entry) for entry in event.bad]
        now = time.monotonic()
        for job in event.jobs:
            if job.deadline_s is not None and job.deadline_s <= now:
                self._answers.append(self.writer.failed(job, ErrorCode.EXPIRED,
                                                        "deadline passed while queued"))
                continue
            slot = self.allocator.acquire()
            assert slot is not None, "a permit always comes with a slot"
            job.slot = slot
            env = job.envelope
            key = self.pool.submit(slot, env.payload, env.content_type, dict(env.params),
                                   urgent=not job.bulk)
            self._pending[key] = job

    def _on_preprocessed(self, record: PreprocDone) -> None:
        assert self.pool is not None
        if self.pool.complete(record):  # else: a stale record of a task that was resubmitted
            self._finish_preprocessing(record)

    def _finish_preprocessing(self, record: PreprocDone) -> None:
        job = self._pending.pop(record.key)
        job.preprocess_ms = record.preprocess_ms
        if record.error_code is not None:
            self._answers.append(self.writer.failed(job, record.error_code, record.message))
            return
        job.ready_s = time.monotonic()
        if job.taken_over:
            # A worker died holding it, maybe because of it: it runs alone, charged one
            # delivery first (see NOTE [ Poison jobs ] in reclaim.py).
            self._suspects.append(job)
        else:
            self.batcher.add(job)

    def _launch(self, batch: list[Job], now: float) -> None:
        if not batch:
            return
        self._model_busy = True
        self._batches.put((batch, [(now - job.ready_s) * 1000 for job in batch]))

    def _on_ran(self, event: _Ran) -> None:
        self._model_busy = False
        n = len(event.batch)
        self.batch_sizes[n] += 1
        if all(o.error is None for o in event.outcomes):
            self.latency.observe(n, event.inference_ms / 1000)
        for job, outcome, wait_ms in zip(event.batch, event.outcomes, event.batch_wait_ms,
                                         strict=True):
            if outcome.error is not None:
                self._answers.append(self.writer.failed(job, outcome.error, outcome.message, n))
            else:
                self._answers.append(self.writer.ok(job, outcome.output, n, event.inference_ms,
                                                    wait_ms))

    def _flush(self) -> None:
        if not self._answers or time.monotonic() < self._retry_at:
            return
        try:
            self.writer.write_and_ack(self._answers)
        except RedisUnavailable as e:
            wait = self._write_backoff.next_wait_s()
            logger.warning("%s; retrying in %.1fs", e, wait)
            self._retry_at = time.monotonic() + wait
            return
        self._write_backoff.reset()
        for answer in self._answers:
            if answer.slot >= 0:
                self.allocator.release(answer.slot)
            self.intake.reclaimer.leases.release(answer.stream, answer.entry_id)
        self.capacity.give_back(len(self._answers),
                                bulk=sum(a.lane is Lane.BULK for a in self._answers))
        self._answers = []

    # ------------------------------------------------------------------ helper threads

    def _intake_loop(self) -> None:
        s = self.settings
        backoff = Backoff()
        while not self._stop.is_set():
            n = self.capacity.take_up_to(s.batch.max_inflight, timeout_s=MAX_IDLE_WAIT_S)
            if n == 0:
                continue
            try:
                jobs, bad = self.intake.read(n, min(n, self.capacity.bulk_room()), s.block_ms)
            except REDIS_ERRORS as e:
                self.capacity.give_back(n)
                wait = backoff.next_wait_s()
                logger.warning("reading jobs failed: %s; retrying in %.1fs", e, wait)
                self._stop.wait(wait)
                continue
            except Exception:  # a bug here must not silently stop the worker from reading
                self.capacity.give_back(n)
                logger.exception("reading jobs failed; retrying")
                self._stop.wait(backoff.next_wait_s())
                continue
            backoff.reset()
            self.capacity.took_bulk(sum(job.bulk for job in jobs))
            self.capacity.give_back(n - len(jobs) - len(bad))
            if jobs or bad:
                self._events.put(_Read(jobs, bad))
            elif not self.intake.recovering:
                self._events.put(_Idle())

    def _model_loop(self) -> None:
        while (item := self._batches.get()) is not None:
            batch, waits = item
            start = time.perf_counter()
            try:
                outcomes = self.runner.run_isolating([j.slot for j in batch],
                                                     [j.envelope.params for j in batch])
            except DeviceFailure as e:
                self._events.put(_DeviceLost(str(e)))
                return
            elapsed_ms = (time.perf_counter() - start) * 1000
            self._events.put(_Ran(batch, outcomes, elapsed_ms, waits))
