"""The heartbeat: a worker says it is alive, and what it is, every couple of seconds.

``redbatch status`` lists a model's workers from it (see "Fleet status keys" in
PROTOCOL.md). Each beat is one MULTI on the model's hash slot: the worker's record
(``SET ... PX``, so a worker that dies silently disappears after three missed beats),
its score in the model's worker set, and pruning of members gone for an hour.

NOTE [ Heartbeat thread ]
  The beat runs in its own daemon thread with its own Redis connection, so a slow
  or unreachable Redis never delays the main loop's steps, and a busy main loop
  never delays the beat. Redis errors are logged once per outage and the thread
  keeps beating: the heartbeat never stops a worker that can serve. ``stop()``
  (from teardown) ends the thread and deletes the record, so a worker that shut
  down cleanly leaves the list at once; one killed drops out when its record expires.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import redis
from redbatch import __version__
from redbatch.common.protocol import (
    HEARTBEAT_INTERVAL_S,
    WORKER_RECORD_TTL_MS,
    WORKERS_TTL_MS,
    Keys,
    WorkerRecord,
)
from redbatch.common.redis_io import REFUSALS, error_code
from redbatch.gpu_worker.metrics import Health

logger = logging.getLogger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


class Heartbeat:
    """Writes this worker's WorkerRecord every HEARTBEAT_INTERVAL_S until stopped.

    ``inflight`` is called from the heartbeat thread; it must only read a counter.
    """

    def __init__(self, r: redis.Redis, keys: Keys, template: WorkerRecord,
                 inflight: Callable[[], int], interval_s: float = HEARTBEAT_INTERVAL_S,
                 health: Health | None = None) -> None:
        self._redis = r
        #: Told when Redis refuses the beat's writes (OOM, READONLY...), so /readyz fails
        #: even while no job is in flight to find out.
        self._health = health
        self.keys = keys
        self._template = template
        self._inflight = inflight
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @classmethod
    def for_worker(cls, r: redis.Redis, keys: Keys, consumer: str, device: str,
                   max_batch_size: int, inflight: Callable[[], int],
                   metrics_port: int | None = None,
                   interval_s: float = HEARTBEAT_INTERVAL_S,
                   health: Health | None = None) -> Heartbeat:
        """A heartbeat describing the calling process as a worker that starts serving now."""
        template = WorkerRecord(consumer=consumer, host=socket.gethostname(), pid=os.getpid(),
                                version=__version__, device=device,
                                max_batch_size=max_batch_size, started_ms=_now_ms(),
                                last_seen_ms=0, inflight=0, metrics_port=metrics_port)
        return cls(r, keys, template, inflight, interval_s, health)

    def start(self) -> None:
        """Beat once now (so the worker is listed as soon as it serves), then in a thread."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="redbatch-heartbeat",
                                        daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Write the record and the set's score; tolerate (log once) an unreachable Redis."""
        now = _now_ms()
        record = replace(self._template, last_seen_ms=now, inflight=self._inflight())
        consumer = self._template.consumer
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.keys.worker(consumer), record.encode(), px=WORKER_RECORD_TTL_MS)
        pipe.zadd(self.keys.workers(), {consumer: now})
        pipe.zremrangebyscore(self.keys.workers(), "-inf", now - WORKERS_TTL_MS)
        pipe.pexpire(self.keys.workers(), WORKERS_TTL_MS)
        try:
            pipe.execute()
        except redis.RedisError as e:  # down, or refusing writes (OOM, read-only replica)
            if not self._failing:
                logger.warning("heartbeat failed (%s); retrying every %.0fs quietly", e,
                               self._interval_s)
            self._failing = True
            if self._health is not None and error_code(e) in REFUSALS:
                self._health.refused("heartbeat", f"{error_code(e)}: {e}")
            return
        if self._failing:
            logger.info("heartbeat written again")
        self._failing = False
        if self._health is not None:
            self._health.accepted("heartbeat")

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.beat()
            except Exception:  # a bug here must not end the beat, nor the worker
                logger.exception("heartbeat failed")

    def stop(self) -> None:
        """End the thread and remove this worker from the listing (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        consumer = self._template.consumer
        try:
            if self._failing:  # Redis is away: don't hold up shutdown; the record expires
                return
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self.keys.worker(consumer))
            pipe.zrem(self.keys.workers(), consumer)
            pipe.execute()
        except redis.RedisError as e:
            logger.warning("could not remove the heartbeat record (%s); it expires in %d s",
                           e, WORKER_RECORD_TTL_MS // 1000)
        finally:
            self._redis.close()
