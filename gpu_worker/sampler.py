"""The sampler: what Redis holds for this model, and the GPU's memory, as metric gauges.

A thread of its own with its own Redis connection, so a slow XINFO never delays
reading jobs. Each sample that reaches Redis also keeps /readyz green; a Redis
error only skips that sample (the intake thread already logs the outage).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from redbatch.common.protocol import GROUP, DeadLetters, Keys, Lane
from redbatch.common.redis_io import REDIS_ERRORS
from redbatch.gpu_worker.metrics import Health, WorkerMetrics

logger = logging.getLogger(__name__)

#: Seconds between samples; Prometheus scrapes every 15 s or so.
SAMPLE_INTERVAL_S = 2.0


class Sampler:
    """Samples stream length, pending and lag per lane, dead letters and GPU memory."""

    def __init__(self, r: redis.Redis, keys: Keys, metrics: WorkerMetrics, health: Health,
                 device: str, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._redis = r
        self.keys = keys
        self.metrics = metrics
        self.health = health
        self.device = device
        self.interval_s = interval_s

    def run(self, stop: threading.Event) -> None:
        """Sample now, then every ``interval_s`` until ``stop`` is set."""
        while True:
            self.sample()
            if stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        """One sample; never raises, so the thread outlives any Redis trouble."""
        try:
            self._sample_redis()
            self.health.redis_reached()
        except REDIS_ERRORS as e:
            logger.debug("sampling Redis failed: %s", e)
        except Exception:
            logger.exception("sampling Redis failed")
        if self.device.startswith("cuda"):
            self._sample_gpu()

    def _sample_redis(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for lane in Lane:
            pipe.xlen(self.keys.stream(lane))
            pipe.xinfo_groups(self.keys.stream(lane))
        DeadLetters(self.keys).length(pipe)
        # A stream deleted under us answers XINFO with an error: that lane reads as empty.
        replies = pipe.execute(raise_on_error=False)
        for i, lane in enumerate(Lane):
            length, groups = replies[2 * i], replies[2 * i + 1]
            if isinstance(length, Exception):
                continue
            pending, lag = group_state(groups, int(length))
            self.metrics.stream_state(lane.value, int(length), pending, lag)
        if not isinstance(replies[-1], Exception):
            self.metrics.dead_letters.set(int(replies[-1]))

    def _sample_gpu(self) -> None:
        import torch

        try:
            self.metrics.gpu_memory(self.device, torch.cuda.memory_allocated(self.device),
                                    torch.cuda.memory_reserved(self.device))
        except Exception:  # a broken device is the model thread's to report, not ours
            logger.debug("sampling GPU memory failed", exc_info=True)


def group_state(groups: Any, length: int) -> tuple[int, int]:
    """(pending, lag) of the workers' group from an XINFO GROUPS reply."""
    if isinstance(groups, Exception):
        return 0, 0
    for group in groups:
        if group["name"] in (GROUP, GROUP.encode()):
            pending = int(group["pending"])
            lag = group.get("lag")
            # Redis < 7 has no lag, and 7 reports nil when entries it cannot count were
            # deleted. Workers XDEL every answered entry, so the stream holds exactly the
            # pending entries plus the unread ones.
            return pending, int(lag) if lag is not None else max(0, length - pending)
    return 0, length
