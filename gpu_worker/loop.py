"""The main loop: one thread owns every piece of the worker's state; the helper threads
only do I/O or compute and hand it events. The worker's lifecycle around it (start-up,
threads, shutdown) is in worker.py.

NOTE [ Worker threads ]

    Redis streams --XREADGROUP--> [intake thread]  --Read--------+
    pool processes --records----> [pump thread]    --records-----+--> events --> [main loop]
    (shared-memory slots)         [collect thread] --Ran---------+    ^              |
                                  [writer thread]  --Written----------+              |
                                  [model thread] <------ batch of slot ids ----------+
    main loop: pool.submit_many (or preprocess inline) -> batcher.add -> pop_ready
               -> model thread (XCLAIM counts a taken-over job's delivery first)
               -> outbox -> writer thread: write_and_ack (SET results, wake-ups,
                  XACK, XDEL in one MULTI per flush) -> Written

  The threads' bodies are in gpu_worker/threads.py, their events and queues in
  events.py, the start-up in startup.py, and the answers waiting to be written
  in outbox.py.

  Only the main loop touches the batcher, the slot allocator, the pool's
  bookkeeping and the answers; the threads hand it events through one queue,
  so there are no locks around state. Work moves in groups: one event per
  intake read, per pool message, per batch and per write. The model thread
  submits a batch and the collect thread waits for its outputs (NOTE [ Device
  path ] in gpu_worker/device/runner.py): on CUDA two batches are in flight, so the
  next batch's copy to the device overlaps this one's compute; on CPU one per
  lane, each lane running its forward pass on a thread of its own. While the
  model is busy, the main loop keeps reading and the next batch grows; while
  a write is in flight, the next one grows (outbox.py).
  Two more threads never touch that state: the sampler (gpu_worker/streams/sampler.py)
  puts what Redis holds into gauges, and the metrics server answers HTTP from
  the metrics and from ``Health``, which the main loop marks on every step.

  Several models (``--model A --model B``): each model has its own intake,
  writer and sampler threads, and its own batcher, places, slots, runner and
  outbox (startup.Served); events say whose they are. The pool's processes,
  the model and collect threads and the device are shared: the device runs at
  most its depth of batches at once, whichever models they are of, and its
  turns go to the models as gpu_worker/batching/scheduler.py says (fair in device time).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter, deque

from redbatch.common.protocol import ErrorCode, Lane, stream_partition
from redbatch.gpu_worker.batching.scheduler import ModelTurns
from redbatch.gpu_worker.batching.shaping import ShapedBatcher
from redbatch.gpu_worker.events import (
    Channels,
    Control,
    DeviceLost,
    Event,
    Idle,
    Ran,
    Read,
    Written,
)
from redbatch.gpu_worker.startup import Parts, Served
from redbatch.gpu_worker.streams.intake import Job
from redbatch.gpu_worker.streams.results import Answer
from redbatch.preproc_worker.worker import PreprocDone, Task, preprocess_group

logger = logging.getLogger(__name__)

#: Longest the main loop sleeps without an event, seconds (bounds reaping and shutdown checks).
MAX_IDLE_WAIT_S = 0.2
#: How often the main loop copies its in-flight counts into metric gauges, seconds.
GAUGES_EVERY_S = 1.0


class MainLoop:
    """The main loop, built whole from the worker's parts (startup.build): it owns their
    state and runs until the worker is stopped (or drained, in burst mode). With several
    models, each has its own batcher, places, slots and outbox (startup.Served); they share
    the pool, and the device's turns go to them as gpu_worker/batching/scheduler.py decides."""

    def __init__(self, parts: Parts, control: Control, channels: Channels) -> None:
        self.settings = parts.settings
        self.control = control
        self.health = control.health
        self.models = parts.models
        self.pool = parts.pool
        self.turns = ModelTurns(len(self.models))
        self._events, self._batches = channels.events, channels.batches
        self.batch_sizes: Counter[int] = Counter()
        self._pending: dict[int, Job] = {}  # pool task key -> job
        self._suspects: deque[Job] = deque()  # jobs delivered before: each runs alone
        self._alone = False  # a suspect job is in the model
        # Batches in flight at once on the shared device: the runners' depth (CUDA: 2,
        # CPU: one per lane), the same for each model.
        self._model_depth = min(m.runner.depth for m in self.models)
        #: Launch times of the batches in the model (launched, not yet Ran), oldest first:
        #: they finish in order.
        self._launched: deque[float] = deque()
        self._stop_deadline: float | None = None
        #: Each job stream's lane, learnt as answers come (the streams of every partition).
        self._lane_of: dict[str, str] = {}
        self._gauges_at = 0.0
        self._burst = self.settings.burst
        self._idle: set[int] = set()  # models whose streams intake found empty (burst mode)
        #: Jobs this loop took in (Read) and has not yet answered. Not capacity.in_use: the
        #: intake thread holds places for its next read too, so that is never 0 between reads.
        self._held = 0

    def run(self) -> None:
        """Step until stopped and drained (or the grace is over), or aborted."""
        try:
            while not self._finished():
                self.step()
        finally:
            if self.batch_sizes:
                logger.info("batch sizes: %s", dict(sorted(self.batch_sizes.items())))

    @property
    def in_use(self) -> int:
        """Jobs read and not yet answered, over every model."""
        return sum(m.capacity.in_use for m in self.models)

    def _finished(self) -> bool:
        if self.control.aborting.is_set():
            return True
        if not self.control.stopping.is_set():
            return False
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.settings.shutdown_grace_s
        drained = self.in_use == 0
        if not drained and time.monotonic() > self._stop_deadline:
            logger.warning("shutdown grace over; %d jobs stay pending", self.in_use)
            return True
        return drained

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        """Handle what arrived, answer expired jobs, launch a batch if due, write answers."""
        self.health.stepped()
        self._handle_events(self._wait_s(time.monotonic()))
        for record in self.pool.reap():
            self._finish_preprocessing(record)
        now = time.monotonic()
        for m in self.models:
            for job in m.batcher.pop_expired(now):
                m.outbox.add(m.writer.failed(job, ErrorCode.EXPIRED, "deadline passed "
                                                                     "before the job could run"))
        if self._launched and now - self._launched[0] > self.settings.batch_timeout_s:
            # A hung CUDA call cannot be interrupted from Python; only a new process helps.
            # Checked whether or not the model is busy: with two lanes or CUDA's two batches
            # in flight, one hung batch leaves room for the others.
            self._handle(DeviceLost(f"a batch has run for over {self.settings.batch_timeout_s:g}"
                                     " s; the device or model looks hung"))
        elif not self._model_busy:
            if self._suspects:
                self._launch_suspect(now)
            else:
                self._launch_ready(now)
        now = time.monotonic()
        for m in self.models:
            m.outbox.ship(now)
        self._update_gauges(now)

    def _update_gauges(self, now: float) -> None:
        if now - self._gauges_at < GAUGES_EVERY_S:
            return
        self._gauges_at = now
        busy = self.pool.busy
        for m in self.models:
            # Leases, not capacity: intake holds free permits while it waits for jobs.
            m.metrics.loop_state(len(m.intake.reclaimer.leases), m.allocator.in_use, busy)

    def _launch_suspect(self, now: float) -> None:
        self._alone = True  # nothing else in the model with it (see _model_busy)
        job = self._suspects.popleft()  # the model thread counts its delivery first
        self._launch(self.models[job.model], [job], now, True)

    def _launch_ready(self, now: float) -> None:
        """The first batch due, offering the device to the models in their fair order."""
        if len(self.models) == 1:
            self._launch(self.models[0], self.models[0].batcher.pop_ready(now), now, False)
            return
        for index in self.turns.order():
            m = self.models[index]
            batch = m.batcher.pop_ready(now)
            if batch:
                self.turns.launched(index)
                self._launch(m, batch, now, False)
                return

    def _wait_s(self, now: float) -> float:
        if self._suspects and not self._model_busy:
            return 0.0
        wakes = [w for m in self.models for w in m.outbox.wake_times()]
        if not self._model_busy:
            for m in self.models:
                wake = m.batcher.next_wakeup(now)
                if wake is not None:
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

    def _handle(self, event: Event) -> None:
        if isinstance(event, list):
            self._on_preprocessed(event)
        elif isinstance(event, Read):
            self._idle.discard(event.model)
            self._held += len(event.jobs) + len(event.bad)
            self._on_read(self.models[event.model], event)
        elif isinstance(event, Ran):
            self._on_ran(self.models[event.model], event)
        elif isinstance(event, Written):
            m = self.models[event.model]
            written, undeliverable = m.outbox.settle(event, time.monotonic())
            if written:
                self._answered(m, written, undeliverable)
        elif isinstance(event, DeviceLost):
            logger.critical("device failure, exiting for a restart (jobs in flight stay "
                            "pending and are taken over): %s", event.message)
            self.control.device_failed = True
            self.control.abort()
        elif isinstance(event, Idle) and self._burst:
            self._idle.add(event.model)
            if len(self._idle) == len(self.models) and self._held == 0:
                logger.info("burst mode: streams drained, stopping")
                self.control.stop()

    def _on_read(self, m: Served, event: Read) -> None:
        """Answer what cannot run, then hand the rest to preprocessing in one group: the
        pool's processes, or this thread for a handler whose preprocessing is trivial."""
        m.outbox.extend(m.writer.rejected(entry) for entry in event.bad)
        now = time.monotonic()
        jobs: list[Job] = []
        for job in event.jobs:
            if job.deadline_s is not None and job.deadline_s <= now:
                m.outbox.add(m.writer.failed(job, ErrorCode.EXPIRED,
                                             "deadline passed while queued"))
                continue
            slot = m.allocator.acquire()
            assert slot is not None, "a permit always comes with a slot"
            job.slot = slot
            jobs.append(job)
        if m.inline is not None:
            inputs = [(j.slot, j.envelope.payload, j.envelope.content_type, j.envelope.params)
                      for j in jobs]
            for job, (code, message, ms, cost, rows) in zip(
                    jobs, preprocess_group(m.inline, m.slots, inputs), strict=True):
                self._preprocessed(m, job, code, message, ms, cost, rows)
            return
        tasks = [Task(j.slot, j.envelope.payload, j.envelope.content_type,
                      dict(j.envelope.params), urgent=not j.bulk, model=m.index) for j in jobs]
        for job, key in zip(jobs, self.pool.submit_many(tasks), strict=True):
            self._pending[key] = job

    def _on_preprocessed(self, records: list[PreprocDone]) -> None:
        # Stale records of tasks that were resubmitted after a crash are dropped here.
        for record in self.pool.complete(records):
            self._finish_preprocessing(record)

    def _finish_preprocessing(self, record: PreprocDone) -> None:
        job = self._pending.pop(record.key)
        self._preprocessed(self.models[job.model], job, record.error_code, record.message,
                           record.preprocess_ms, record.cost, record.rows)

    def _preprocessed(self, m: Served, job: Job, code: ErrorCode | None, message: str,
                      ms: float, cost: int, rows: int) -> None:
        job.preprocess_ms, job.cost, job.rows = ms, cost, rows
        if code is not None:
            m.outbox.add(m.writer.failed(job, code, message))
            return
        job.ready_s = time.monotonic()
        if job.taken_over:
            # A worker died holding it, maybe because of it: it runs alone, charged one
            # delivery first (see NOTE [ Poison jobs ] in reclaim.py).
            self._suspects.append(job)
        else:
            m.batcher.add(job)

    def _launch(self, m: Served, batch: list[Job], now: float, suspect: bool) -> None:
        if not batch:
            return
        self._launched.append(now)
        self._batches.put((m.index, batch, [(now - job.ready_s) * 1000 for job in batch],
                           m.batcher.run_size(len(batch)), suspect))

    @property
    def _model_busy(self) -> bool:
        # A suspect runs alone: it may take the whole process down with it.
        depth = 1 if self._suspects or self._alone else self._model_depth
        return len(self._launched) >= depth

    def _on_ran(self, m: Served, event: Ran) -> None:
        self._launched.popleft()
        self._alone = False
        n = len(event.batch)
        seconds = event.inference_ms / 1000
        self.batch_sizes[n] += 1
        self.turns.ran(m.index, (event.device_ms or event.inference_ms) / 1000)
        m.metrics.batch(n, seconds)
        m.metrics.tokens([(job.cost, job.rows) for job in event.batch])
        if all(o.error is None for o in event.outcomes):
            m.latency.observe(event.run_size or n, seconds)
            if isinstance(m.batcher, ShapedBatcher):  # time by rows and padded length
                m.batcher.observe(sum(job.rows for job in event.batch),
                                  m.batcher.padded_length(event.batch), seconds)
        m.batcher.set_limit(m.runner.batch_limit)  # lowered when device memory is short
        m.outbox.extend(m.writer.ran(event.batch, event.outcomes, event.batch_wait_ms,
                                     event.inference_ms))

    def _answered(self, m: Served, answers: list[Answer], undeliverable: int) -> None:
        """Release what the written answers held, and count them."""
        m.allocator.release_many(a.slot for a in answers if a.slot >= 0)
        m.intake.reclaimer.leases.release((a.stream, a.entry_id) for a in answers)
        # Counted once written: a result that failed to write is retried, not lost.
        lane_of = self._lane_of
        for a in answers:
            if a.stream not in lane_of:
                lane_of[a.stream] = stream_partition(a.stream)[1].value
        m.metrics.answered((lane_of[a.stream], a.outcome, a.timings,
                            a.dead_letter is not None) for a in answers)
        m.metrics.dead_lettered.inc(undeliverable)
        m.capacity.give_back(len(answers), bulk=sum(a.lane is Lane.BULK for a in answers))
        self._held -= len(answers)
