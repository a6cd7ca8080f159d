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
  so there are no locks around state. The model thread submits a batch and
  the collect thread waits for its outputs (NOTE [ Device path ] in
  gpu_worker/model.py): on CUDA two batches are in flight, so the next batch's
  copy to the device overlaps this one's compute; on CPU one per lane, each
  lane running its forward pass on a thread of its own. While the model is
  busy, the main loop keeps reading and the next batch grows.
  Two more threads never touch that state: the sampler (gpu_worker/sampler.py)
  puts what Redis holds into gauges, and the metrics server answers HTTP from
  the metrics and from ``Health``, which the main loop marks on every step.

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
import os
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import redis
from redbatch import __version__
from redbatch.common.config import Settings
from redbatch.common.protocol import ErrorCode, Keys, Lane
from redbatch.common.redis_io import (
    REDIS_ERRORS,
    Backoff,
    RedisRefused,
    RedisUnavailable,
    connect,
    error_code,
)
from redbatch.gpu_worker import malloc_tuning
from redbatch.gpu_worker.batcher import Batcher, LanePolicy, LatencyEstimator
from redbatch.gpu_worker.capacity import Capacity
from redbatch.gpu_worker.heartbeat import Heartbeat
from redbatch.gpu_worker.intake import BadEntry, Intake, Job
from redbatch.gpu_worker.metrics import Health, MetricsServer, WorkerMetrics
from redbatch.gpu_worker.model import DeviceFailure, Outcome
from redbatch.gpu_worker.results import Answer, ResultWriter
from redbatch.gpu_worker.sampler import Sampler
from redbatch.handlers.base import Handler, load_handler
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotAllocator, SlotArray
from redbatch.preproc_worker.worker import PreprocDone

logger = logging.getLogger(__name__)

#: Longest the main loop sleeps without an event, seconds (bounds reaping and shutdown checks).
MAX_IDLE_WAIT_S = 0.2
#: How often the main loop copies its in-flight counts into metric gauges, seconds.
GAUGES_EVERY_S = 1.0


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
    #: The size it ran at (padded up to a preferred size), for the latency estimator.
    run_size: int = 0


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
        # Unbounded, but the main loop launches at most _model_depth batches (_model_busy).
        self._batches: queue.SimpleQueue[tuple[list[Job], list[float], int] | None] = \
            queue.SimpleQueue()
        self._collecting: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._ready = threading.Event()
        self._answers: list[Answer] = []
        self._pending: dict[int, Job] = {}  # pool task key -> job
        self._suspects: deque[Job] = deque()  # jobs delivered before: each runs alone
        self._alone = False  # a suspect job is in the model
        self._model_depth = 1  # batches in flight at once: the runner's depth (CUDA, CPU lanes)
        #: Launch times of the batches in the model (launched, not yet _Ran), oldest first:
        #: they finish in order.
        self._launched: deque[float] = deque()
        self._retry_at = 0.0
        self._write_backoff = Backoff()
        #: Answers the writer held back (dead letters while the dead-letter stream cannot
        #: take them: NOTE [ Write failures ] in results.py), retried on their own clock so
        #: that the other answers are not delayed.
        self._held: list[Answer] = []
        self._held_retry_at = 0.0
        self._held_backoff = Backoff()
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
        self.tuned: Any = None
        self.heartbeat: Heartbeat | None = None
        self.metrics = WorkerMetrics(self.keys.model, b.max_batch_size)
        self.health = Health()
        self._metrics_server = MetricsServer(self.metrics, self.health)
        self._lane_of = {self.keys.stream(lane): lane.value for lane in Lane}
        self._gauges_at = 0.0

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Graceful: stop reading, finish in-flight work, exit. Safe from a signal handler."""
        self.health.stopping = True
        self._stop.set()

    def abort(self) -> None:
        """Leave at once; unanswered jobs stay pending in Redis."""
        self.health.stopping = True
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
        """Model and its tuning first (the profile may change the batch sizes, and so the
        slots), then the pool (its processes start while the model warms up), then Redis."""
        s = self.settings
        logger.info("starting worker %s for model %s: %r", s.consumer, self.keys.model, s)
        metrics_on = False
        if s.metrics_port:  # first, so /healthz answers while the model loads
            metrics_on = self._metrics_server.start(s.metrics_host, s.metrics_port)
        handler = load_handler(s.model.spec, s.limits)
        self._tune(handler)  # before the pool: the profile may change the batch sizes
        s = self.settings
        self._start_pool(handler)
        self._load_model(handler)
        self.intake = Intake(connect(s.redis), self.keys, s.consumer, s.limits.max_payload_bytes,
                             s.reclaim_idle_ms, s.max_deliveries)
        self._wait_for_redis()
        self.writer = ResultWriter(connect(s.redis), self.keys, s.consumer, s.result_ttl_s)
        self._start_threads()
        # Jobs holding a slot are the ones read and not yet answered (capacity also counts
        # the permits intake holds while it waits for jobs). A len() read from the heartbeat
        # thread; only the main loop changes it.
        self.heartbeat = Heartbeat.for_worker(
            connect(s.redis), self.keys, s.consumer, str(self.runner.device),
            s.batch.max_batch_size, lambda: self.allocator.in_use,
            self._metrics_server.port if metrics_on else None, health=self.health)
        self.heartbeat.start()
        self._ready.set()

    def _wait_for_redis(self) -> None:
        """Create the consumer groups, waiting out a Redis that is down or refuses them
        (out of memory, a replica, a key of another type where a stream belongs): no crash
        loop, and the worker is not ready meanwhile."""
        backoff = Backoff()
        while True:
            try:
                self.intake.ensure_groups()
                self.health.accepted("reads")
                return
            except redis.RedisError as e:
                wait = backoff.next_wait_s()
                if isinstance(e, REDIS_ERRORS):
                    logger.warning("Redis not reachable (%s); retrying in %.1fs", e, wait)
                else:
                    self.health.refused("reads", f"{error_code(e)}: {e}")
                    logger.error("cannot create the consumer groups on %s (%s); retrying in "
                                 "%.1fs", ", ".join(self.keys.streams()), e, wait)
                if self._stop.wait(wait):
                    raise RedisUnavailable("stopped while waiting for Redis") from e

    def _start_pool(self, handler: Handler) -> None:
        from redbatch.preproc_worker.shm import sweep_orphans

        s = self.settings
        # What dead workers with our prefix left in /dev/shm (NOTE [ Shared-memory lifetime ]).
        sweep_orphans(s.pool.shm_prefix)
        self.slots = SlotArray.create(s.batch.max_inflight, handler.input_shape,
                                      handler.input_dtype, s.pool.shm_prefix)
        self.allocator = SlotAllocator(s.batch.max_inflight)
        self.pool = PreprocPool(s.model.spec, s.limits, s.pool, self.slots.layout)
        self.pool.start(on_done=self._events.put)

    def _tune(self, handler: Handler) -> None:
        """Threads, device, model and calibration profile (gpu_worker/tuning/apply.py); the
        batching pieces that depend on the max batch are rebuilt from the result."""
        from redbatch.gpu_worker.tuning.apply import tune

        self.tuned = tune(self.settings, handler)
        for note in self.tuned.notes:
            logger.info("tuning: %s", note)
        s = self.settings = self.tuned.settings
        b = s.batch
        self.capacity = Capacity(b.max_inflight, b.max_inflight - b.interactive_reserve)
        self.batcher = Batcher(b.max_batch_size, b.max_wait_ms / 1000, self.latency,
                               self.batcher.lanes, self.tuned.preferred_sizes,
                               self.tuned.always_round_up)
        self.metrics.max_batch_size = b.max_batch_size
        self.latency.seed(self.tuned.latency_s)

    def _load_model(self, handler: Handler) -> None:
        import torch
        from redbatch.gpu_worker.model import ModelRunner
        from redbatch.gpu_worker.tuning.apply import warmup_sizes

        s, tuned = self.settings, self.tuned
        assert self.slots is not None
        device = tuned.device
        self.runner = ModelRunner(handler, device, self.slots.array, s.batch.max_batch_size,
                                  tuned.variant, model=tuned.model,
                                  memory_watermark=s.tune.memory_watermark, lanes=tuned.lanes)
        self._model_depth = self.runner.depth
        sizes = warmup_sizes(s.batch.max_batch_size, tuned.preferred_sizes, self.runner.pipelined)
        for size, seconds in self.runner.warmup(sizes).items():
            if size not in tuned.latency_s:  # measured times from the profile are better
                self.latency.observe(size, seconds)
        self.metrics.started(s.consumer, __version__, str(device), s.pool.processes,
                             s.batch.max_inflight)
        self.health.model_loaded = True
        logger.info("model ready: device=%s torch_threads=%d pool=%d max_batch=%d "
                    "max_wait_ms=%g variant=%s preferred_batch_sizes=%s", device,
                    torch.get_num_threads(), s.pool.processes, s.batch.max_batch_size,
                    s.batch.max_wait_ms, tuned.variant.name, list(tuned.preferred_sizes))
        if device.type == "cpu":
            logger.info("cpu path: %d batches at once on %d torch threads each, %d cores, "
                        "beside %d preprocessing processes; %s memory format; %s",
                        self.runner.depth, torch.get_num_threads(), os.cpu_count() or 1,
                        s.pool.processes, "channels_last" if s.model.channels_last else "NCHW",
                        malloc_tuning.describe())

    def _start_threads(self) -> None:
        for name, target in (("intake", self._intake_loop), ("model", self._model_loop),
                             ("collect", self._collect_loop), ("sampler", self._sampler_loop)):
            thread = threading.Thread(target=target, name=f"redbatch-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def teardown(self) -> None:
        self._stop.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
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
        self._metrics_server.close()
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
        self.health.stepped()
        self._handle_events(self._wait_s(time.monotonic()))
        assert self.pool is not None
        for record in self.pool.reap():
            self._finish_preprocessing(record)
        now = time.monotonic()
        for job in self.batcher.pop_expired(now):
            self._answers.append(self.writer.failed(job, ErrorCode.EXPIRED, "deadline passed "
                                                    "before the job could run"))
        if self._launched and now - self._launched[0] > self.settings.batch_timeout_s:
            # A hung CUDA call cannot be interrupted from Python; only a new process helps.
            # Checked whether or not the model is busy: with two lanes or CUDA's two batches
            # in flight, one hung batch leaves room for the others.
            self._handle(_DeviceLost(f"a batch has run for over {self.settings.batch_timeout_s:g}"
                                     " s; the device or model looks hung"))
        elif not self._model_busy:
            self._launch(self._next_suspect() or self.batcher.pop_ready(now), now)
        self._flush()
        self._update_gauges(now)

    def _update_gauges(self, now: float) -> None:
        if now - self._gauges_at < GAUGES_EVERY_S:
            return
        self._gauges_at = now
        assert self.pool is not None
        # Leases, not capacity: intake holds free permits while it waits for jobs.
        self.metrics.loop_state(len(self.intake.reclaimer.leases), self.allocator.in_use,
                                self.pool.busy)

    def _next_suspect(self) -> list[Job]:
        if not self._suspects:
            return []
        job = self._suspects.popleft()
        self._alone = True  # nothing else in the model with it (see _model_busy)
        try:
            self.intake.reclaimer.charge(job.stream, job.entry_id)
        except redis.RedisError as e:
            # Unreachable, refused, or the group gone (Redis restarted empty): it runs
            # uncounted this once; the lease and the next takeover still bound it.
            logger.warning("could not count a delivery of taken-over job %s (%s); running "
                           "it anyway", job.request_id, e)
        return [job]

    def _wait_s(self, now: float) -> float:
        if self._suspects and not self._model_busy:
            return 0.0
        wakes = [self._retry_at] if self._answers else []
        if self._held:
            wakes.append(self._held_retry_at)
        wake = self.batcher.next_wakeup(now)
        if wake is not None and not self._model_busy:
            wakes.append(wake)
        return max(0.0, min([w - now for w in wakes] + [MAX_IDLE_WAIT_S]))

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
        self._launched.append(now)
        self._batches.put((batch, [(now - job.ready_s) * 1000 for job in batch],
                           self.batcher.run_size(len(batch))))

    @property
    def _model_busy(self) -> bool:
        # A suspect runs alone: it may take the whole process down with it.
        depth = 1 if self._suspects or self._alone else self._model_depth
        return len(self._launched) >= depth

    def _on_ran(self, event: _Ran) -> None:
        self._launched.popleft()
        self._alone = False
        n = len(event.batch)
        self.batch_sizes[n] += 1
        self.metrics.batch(n, event.inference_ms / 1000)
        if all(o.error is None for o in event.outcomes):
            self.latency.observe(event.run_size or n, event.inference_ms / 1000)
        self.batcher.set_limit(self.runner.batch_limit)  # lowered when device memory is short
        for job, outcome, wait_ms in zip(event.batch, event.outcomes, event.batch_wait_ms,
                                         strict=True):
            if outcome.error is not None:
                self._answers.append(self.writer.failed(job, outcome.error, outcome.message, n))
            else:
                self._answers.append(self.writer.ok(job, outcome.output, n, event.inference_ms,
                                                    wait_ms))

    def _flush(self) -> None:
        """Write the answers and acknowledge their entries (NOTE [ Write failures ] in
        results.py); a refused or failed write is retried with back-off."""
        now = time.monotonic()
        if self._held and now >= self._held_retry_at:
            self._answers += self._held
            self._held = []
        if not self._answers or now < self._retry_at:
            return
        try:
            flushed = self.writer.write_and_ack(self._answers)
        except (RedisUnavailable, RedisRefused) as e:
            wait = self._write_backoff.next_wait_s()
            if isinstance(e, RedisRefused):
                self.health.refused("writes", str(e))
            logger.warning("%s; retrying in %.1fs", e, wait)
            self._retry_at = now + wait
            return
        self._write_backoff.reset()
        self.health.accepted("writes")
        self._hold(flushed.held, now)
        held = {id(a) for a in flushed.held}
        self._answered([a for a in self._answers if id(a) not in held], flushed.undeliverable)
        self._answers = []

    def _hold(self, held: list[Answer], now: float) -> None:
        if held:
            self._held = held
            self._held_retry_at = now + self._held_backoff.next_wait_s()
        else:
            self._held_backoff.reset()

    def _answered(self, answers: list[Answer], undeliverable: int) -> None:
        """Release what the written answers held, and count them."""
        for answer in answers:
            if answer.slot >= 0:
                self.allocator.release(answer.slot)
            self.intake.reclaimer.leases.release(answer.stream, answer.entry_id)
            # Counted once written: a result that failed to write is retried, not lost.
            self.metrics.answered(self._lane_of[answer.stream], answer.outcome, answer.timings,
                                  dead_lettered=answer.dead_letter is not None)
        self.metrics.dead_lettered.inc(undeliverable)
        self.capacity.give_back(len(answers), bulk=sum(a.lane is Lane.BULK for a in answers))

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
            except redis.ResponseError as e:  # a replica, a stream replaced by another type
                self.capacity.give_back(n)
                wait = backoff.next_wait_s()
                self.health.refused("reads", f"{error_code(e)}: {e}")
                logger.warning("Redis refused reading jobs (%s); retrying in %.1fs", e, wait)
                self._stop.wait(wait)
                continue
            except Exception:  # a bug here must not silently stop the worker from reading
                self.capacity.give_back(n)
                logger.exception("reading jobs failed; retrying")
                self._stop.wait(backoff.next_wait_s())
                continue
            backoff.reset()
            self.health.accepted("reads")
            self.metrics.reclaimed(sum(job.taken_over for job in jobs))
            self.capacity.took_bulk(sum(job.bulk for job in jobs))
            self.capacity.give_back(n - len(jobs) - len(bad))
            if jobs or bad:
                self._events.put(_Read(jobs, bad))
            elif not self.intake.recovering:
                self._events.put(_Idle())

    def _model_loop(self) -> None:
        """Submit each batch (on CUDA this returns before it has run)."""
        while (item := self._batches.get()) is not None:
            batch, waits, size = item
            job = self.runner.submit([j.slot for j in batch], [j.envelope.params for j in batch],
                                     size)
            self._collecting.put((batch, waits, job))
        self._collecting.put(None)

    def _collect_loop(self) -> None:
        """Wait for each submitted batch in order, postprocess, hand the outcomes over."""
        while (item := self._collecting.get()) is not None:
            batch, waits, job = item
            try:
                outcomes = self.runner.collect(job)
            except DeviceFailure as e:
                self._events.put(_DeviceLost(str(e)))
                return
            self._events.put(_Ran(batch, outcomes, job.run_s * 1000, waits, job.size))

    def _sampler_loop(self) -> None:
        s = self.settings
        Sampler(connect(s.redis), self.keys, self.metrics, self.health,
                str(self.runner.device)).run(self._stop)
