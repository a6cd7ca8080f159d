"""The worker process's lifecycle: start every part in one phase, start the helper threads,
run the main loop (loop.py), and always tear down.

NOTE [ Worker shutdown ]
  1. First SIGTERM/SIGINT (``stop``): intake stops reading; the main loop
     finishes what is in flight, writes and acknowledges, for at most
     ``shutdown_grace_s``; then teardown. A signal during start-up ends the
     wait for Redis, and the worker tears down what it had built.
  2. Second signal (``abort``): the main loop leaves at once. Jobs read but
     not answered stay pending in Redis: nothing is acknowledged without its
     result, so they are served again.
  3. Teardown, on every exit path (one ExitStack, in the reverse order of
     start-up): stop the heartbeat, stop the threads, close the model, stop the
     pool processes, unlink the shared-memory segment, close the metrics server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from redbatch.common.config import Settings, redact_url
from redbatch.gpu_worker.device.prepare import memory_in_use
from redbatch.gpu_worker.events import Channels, Control
from redbatch.gpu_worker.loop import MAX_IDLE_WAIT_S, MainLoop
from redbatch.gpu_worker.metrics import Health, MetricsServer, WorkerMetrics
from redbatch.gpu_worker.startup import Parts, Served, build, connect_waiting
from redbatch.gpu_worker.streams.heartbeat import Heartbeat
from redbatch.gpu_worker.streams.sampler import Sampler
from redbatch.gpu_worker.threads import Reader, collect_batches, submit_batches, write_answers
from redbatch.preproc_worker.shm import SlotAllocator

logger = logging.getLogger(__name__)

#: How long teardown waits for each helper thread after a graceful stop, s.
THREAD_JOIN_S = 10.0


class Worker:
    """Serves its models (one, or several sharing its pool and device) from their Redis
    streams until stopped (or drained, in burst mode). Built before anything starts, so
    that a signal can stop it from the first moment."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.control = Control(Health())
        self.channels = Channels()
        #: The first model's metrics; the others' share their registry (startup.build).
        self.metrics = WorkerMetrics(settings.model.served_name, settings.batch.max_batch_size)
        self._metrics_server = MetricsServer(self.metrics, self.control.health)

    @property
    def device_failed(self) -> bool:
        """The device broke: the worker command exits with code 3 for a restart."""
        return self.control.device_failed

    def stop(self) -> None:
        self.control.stop()

    def abort(self) -> None:
        self.control.abort()

    def run(self) -> None:
        """Start, serve until stopped, and always tear down (NOTE [ Worker shutdown ])."""
        s = self.settings
        pool = s.pool.processes or "auto"
        models = ", ".join(f"{m.served_name} ({m.spec})" for m in s.models)
        logger.info("starting worker %s for model%s %s: redis=%r prefix=%r device=%s "
                    "max_batch=%d max_wait_ms=%g max_inflight=%d pool=%s calibrate=%s",
                    s.consumer, "s" if s.more_models else "", models,
                    redact_url(s.redis.url), s.redis.prefix, s.model.device,
                    s.batch.max_batch_size, s.batch.max_wait_ms, s.batch.max_inflight, pool,
                    s.tune.calibrate)
        logger.debug("all settings: %r", s)
        with ExitStack() as stack:
            stack.callback(logger.info, "worker %s stopped", s.consumer)
            metrics_on = bool(s.metrics_port) and self._start_metrics(stack)
            parts = build(s, self.metrics, self.control.health, self.channels.events.put,
                          self.control.stopping, stack)
            self.settings = parts.settings
            loop = MainLoop(parts, self.control, self.channels)
            self._start_threads(parts, stack)
            self._start_heartbeat(parts, metrics_on, stack)
            stack.callback(self.control.stopping.set)  # first: every thread sees it
            loop.run()

    def _start_metrics(self, stack: ExitStack) -> bool:
        """First, so that /healthz answers while the model loads."""
        s = self.settings
        stack.callback(self._metrics_server.close)
        return self._metrics_server.start(s.metrics_host, s.metrics_port)

    def _start_threads(self, parts: Parts, stack: ExitStack) -> None:
        """The shared model and collect threads, and each model's intake, writer and
        sampler threads (NOTE [ Worker threads ] in loop.py)."""
        ch, models = self.channels, parts.models
        runners = [m.runner for m in models]
        threads: list[tuple[str, Callable[..., None], tuple[Any, ...]]] = [
            ("model", submit_batches, (runners, [m.intake.reclaimer for m in models],
                                       ch.batches, ch.collecting)),
            ("collect", collect_batches, (runners, ch.collecting, ch.events.put))]
        for m in models:
            threads += self._model_threads(m, f"-{m.name}" if len(models) > 1 else "")
        started: list[threading.Thread] = []
        stack.callback(self._stop_threads, started, models)
        for name, target, args in threads:
            thread = threading.Thread(target=target, args=args, name=f"redbatch-{name}",
                                      daemon=True)
            thread.start()
            started.append(thread)

    def _model_threads(self, m: Served, suffix: str) -> list[tuple[str, Callable[..., None],
                                                                  tuple[Any, ...]]]:
        s, ch, stop, health = m.settings, self.channels, self.control.stopping, \
            self.control.health
        reader = Reader(m.intake, m.capacity, m.metrics, health, ch.events.put, m.index)
        # Waiting: a cluster client reads the slot map when made, and the cluster may be
        # away by now (a worker that started must never exit for that).
        sampler = Sampler(connect_waiting(s.redis, stop), m.intake.keys, m.metrics, health,
                          str(m.runner.device), gpu_memory=memory_in_use)
        return [("intake" + suffix, reader.run,
                 (stop, s.batch.max_inflight, s.block_ms, MAX_IDLE_WAIT_S)),
                ("writer" + suffix, write_answers, (m.writer, m.outgoing, ch.events.put,
                                                    m.index)),
                ("sampler" + suffix, sampler.run, (stop,))]

    def _stop_threads(self, threads: list[threading.Thread], models: list[Served]) -> None:
        self.channels.batches.put(None)
        for m in models:
            m.outgoing.put(None)
        for thread in threads:
            thread.join(timeout=0 if self.control.aborting.is_set() else THREAD_JOIN_S)

    def _start_heartbeat(self, parts: Parts, metrics_on: bool, stack: ExitStack) -> None:
        """One heartbeat per model, in its registry (``redbatch status`` shows the worker
        under each model it serves). Jobs holding a slot are the ones read and not yet
        answered (capacity also counts the permits intake holds while it waits for jobs).
        A len() read from the heartbeat thread; only the main loop changes it."""
        for m in parts.models:
            s = m.settings
            heartbeat = Heartbeat.for_worker(
                connect_waiting(s.redis, self.control.stopping), m.intake.keys, s.consumer,
                str(m.runner.device),
                s.batch.max_batch_size, _in_use(m.allocator),
                self._metrics_server.port if metrics_on else None, health=self.control.health)
            heartbeat.start()
            stack.callback(heartbeat.stop)


def _in_use(allocator: SlotAllocator) -> Callable[[], int]:
    """How many of ``allocator``'s slots hold a job, read when called."""
    return lambda: allocator.in_use
