"""The worker: one main loop owns every piece of state; helper threads only do I/O or compute.

NOTE [ Worker threads ]

    Redis streams --XREADGROUP--> [intake thread]  --Read--------+
    pool processes --records----> [pump thread]    --PreprocDone-+--> events --> [main loop]
    (shared-memory slots)         [collect thread] --Ran---------+                   |
                                  [model thread] <------ batch of slot ids ----------+
    main loop: pool.submit -> batcher.add -> batcher.pop_ready -> model thread
               -> Outbox.flush -> ResultWriter.write_and_ack (SET result, RPUSH done, XACK, XDEL)

  The threads' bodies are in gpu_worker/threads.py, their events in events.py,
  the start-up steps in startup.py, and the answers waiting to be written in
  outbox.py.

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
import queue
import threading
import time
from collections import Counter, deque
from typing import Any

import redis
from redbatch.common.config import Settings
from redbatch.common.protocol import ErrorCode, Keys, Lane
from redbatch.common.redis_io import (
    connect,
)
from redbatch.gpu_worker.batcher import LatencyEstimator
from redbatch.gpu_worker.events import DeviceLost, Event, Idle, Ran, Read
from redbatch.gpu_worker.heartbeat import Heartbeat
from redbatch.gpu_worker.intake import Intake, Job
from redbatch.gpu_worker.metrics import Health, MetricsServer, WorkerMetrics
from redbatch.gpu_worker.outbox import Outbox
from redbatch.gpu_worker.results import Answer, ResultWriter
from redbatch.gpu_worker.sampler import Sampler
from redbatch.gpu_worker.startup import batching, load_model, start_pool, wait_for_redis
from redbatch.gpu_worker.threads import Launch, Reader, collect_batches, submit_batches
from redbatch.handlers.base import Handler, load_handler
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotArray
from redbatch.preproc_worker.worker import PreprocDone

logger = logging.getLogger(__name__)

#: Longest the main loop sleeps without an event, seconds (bounds reaping and shutdown checks).
MAX_IDLE_WAIT_S = 0.2
#: How often the main loop copies its in-flight counts into metric gauges, seconds.
GAUGES_EVERY_S = 1.0


class Worker:
    """Serves one model from its Redis streams until stopped (or drained, in burst mode)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.model.served_name, settings.redis.prefix)
        self.batch_sizes: Counter[int] = Counter()
        self._events: queue.Queue[Event] = queue.Queue()
        # Unbounded, but the main loop launches at most _model_depth batches (_model_busy).
        self._batches: queue.SimpleQueue[Launch | None] = queue.SimpleQueue()
        self._collecting: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._pending: dict[int, Job] = {}  # pool task key -> job
        self._suspects: deque[Job] = deque()  # jobs delivered before: each runs alone
        self._alone = False  # a suspect job is in the model
        self._model_depth = 1  # batches in flight at once: the runner's depth (CUDA, CPU lanes)
        #: Launch times of the batches in the model (launched, not yet Ran), oldest first:
        #: they finish in order.
        self._launched: deque[float] = deque()
        self._stop_deadline: float | None = None
        #: Set when the device broke; the worker command then exits non-zero.
        self.device_failed = False
        self._threads: list[threading.Thread] = []
        b = settings.batch
        self.latency = LatencyEstimator()
        self.capacity, self.batcher = batching(b, self.latency)
        self.pool: PreprocPool | None = None
        self.slots: SlotArray | None = None
        self.runner: Any = None
        self.tuned: Any = None
        self.heartbeat: Heartbeat | None = None
        self.metrics = WorkerMetrics(self.keys.model, b.max_batch_size)
        self.health = Health()
        self.outbox = Outbox(self.health)
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
        self.slots, self.allocator, self.pool = start_pool(s, handler, self._events.put)
        self.runner = load_model(s, self.tuned, handler, self.slots, self.latency, self.metrics)
        self._model_depth = self.runner.depth
        self.health.model_loaded = True
        self.intake = Intake(connect(s.redis), self.keys, s.consumer, s.limits.max_payload_bytes,
                             s.reclaim_idle_ms, s.max_deliveries)
        wait_for_redis(self.intake, self.health, self._stop)
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

    def _tune(self, handler: Handler) -> None:
        """Threads, device, model and calibration profile (gpu_worker/tuning/apply.py); the
        batching pieces that depend on the max batch are rebuilt from the result."""
        from redbatch.gpu_worker.tuning.apply import tune

        self.tuned = tune(self.settings, handler)
        for note in self.tuned.notes:
            logger.info("tuning: %s", note)
        s = self.settings = self.tuned.settings
        b = s.batch
        self.capacity, self.batcher = batching(b, self.latency, self.tuned.preferred_sizes,
                                               self.tuned.always_round_up)
        self.metrics.max_batch_size = b.max_batch_size
        self.latency.seed(self.tuned.latency_s)

    def _start_threads(self) -> None:
        s = self.settings
        reader = Reader(self.intake, self.capacity, self.metrics, self.health, self._events.put)
        sampler = Sampler(connect(s.redis), self.keys, self.metrics, self.health,
                          str(self.runner.device))
        for name, target, args in (
                ("intake", reader.run, (self._stop, s.batch.max_inflight, s.block_ms,
                                        MAX_IDLE_WAIT_S)),
                ("model", submit_batches, (self.runner, self._batches, self._collecting)),
                ("collect", collect_batches, (self.runner, self._collecting, self._events.put)),
                ("sampler", sampler.run, (self._stop,))):
            thread = threading.Thread(target=target, args=args, name=f"redbatch-{name}",
                                      daemon=True)
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
            self.outbox.add(self.writer.failed(job, ErrorCode.EXPIRED, "deadline passed "
                                                    "before the job could run"))
        if self._launched and now - self._launched[0] > self.settings.batch_timeout_s:
            # A hung CUDA call cannot be interrupted from Python; only a new process helps.
            # Checked whether or not the model is busy: with two lanes or CUDA's two batches
            # in flight, one hung batch leaves room for the others.
            self._handle(DeviceLost(f"a batch has run for over {self.settings.batch_timeout_s:g}"
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
        wakes = self.outbox.wake_times()
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
        elif isinstance(event, Read):
            self._on_read(event)
        elif isinstance(event, Ran):
            self._on_ran(event)
        elif isinstance(event, DeviceLost):
            logger.critical("device failure, exiting for a restart (jobs in flight stay "
                            "pending and are taken over): %s", event.message)
            self.device_failed = True
            self.abort()
        elif isinstance(event, Idle) and self.settings.burst and self.capacity.in_use == 0:
            logger.info("burst mode: streams drained, stopping")
            self.stop()

    def _on_read(self, event: Read) -> None:
        assert self.pool is not None
        self.outbox.extend(self.writer.rejected(entry) for entry in event.bad)
        now = time.monotonic()
        for job in event.jobs:
            if job.deadline_s is not None and job.deadline_s <= now:
                self.outbox.add(self.writer.failed(job, ErrorCode.EXPIRED,
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
            self.outbox.add(self.writer.failed(job, record.error_code, record.message))
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

    def _on_ran(self, event: Ran) -> None:
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
                self.outbox.add(self.writer.failed(job, outcome.error, outcome.message, n))
            else:
                self.outbox.add(self.writer.ok(job, outcome.output, n, event.inference_ms,
                                                    wait_ms))

    def _flush(self) -> None:
        """Write the answers due (gpu_worker/outbox.py), then let go of what they held."""
        written, undeliverable = self.outbox.flush(self.writer, time.monotonic())
        if written:
            self._answered(written, undeliverable)

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
