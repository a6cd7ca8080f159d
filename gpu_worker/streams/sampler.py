"""The sampler: what Redis holds for this model, and the GPU's memory, as metric gauges.

A thread of its own with its own Redis connection, so a slow XINFO never delays
reading jobs. Each sample that reaches Redis also keeps /readyz green; a Redis
error only skips that sample (the intake thread already logs the outage). The stream
and dead-letter gauges are summed over the model's partitions (PROTOCOL.md "Partitions"),
whose count the sampler reads again every few seconds as the intake does; one pipeline
reads them all.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from redbatch.common.protocol import GROUP, DeadLetters, Keys, Lane
from redbatch.common.redis_io import REDIS_ERRORS
from redbatch.gpu_worker.metrics import Health, WorkerMetrics
from redbatch.gpu_worker.streams.partitions import PartitionSet

logger = logging.getLogger(__name__)

#: Seconds between samples; Prometheus scrapes every 15 s or so.
SAMPLE_INTERVAL_S = 2.0


class Sampler:
    """Samples stream length, pending and lag per lane and dead letters (each summed over
    the model's partitions), and GPU memory."""

    def __init__(self, r: redis.Redis, keys: Keys, metrics: WorkerMetrics, health: Health,
                 device: str, interval_s: float = SAMPLE_INTERVAL_S,
                 gpu_memory: Callable[[str], tuple[int, int]] | None = None) -> None:
        self._redis = r
        self.keys = keys
        self.partitions = PartitionSet(r, keys)
        self.metrics = metrics
        self.health = health
        self.device = device
        self.interval_s = interval_s
        #: (allocated, reserved) bytes of a CUDA device (device/prepare.py memory_in_use).
        self._gpu_memory = gpu_memory

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
        if self._gpu_memory is not None and self.device.startswith("cuda"):
            self._sample_gpu(self._gpu_memory)

    def _sample_redis(self) -> None:
        self.partitions.refresh()
        pipe = self._redis.pipeline(transaction=False)
        for keys in self.partitions.parts:
            for lane in Lane:
                pipe.xlen(keys.stream(lane))
                pipe.xinfo_groups(keys.stream(lane))
            DeadLetters(keys).length(pipe)
        # A stream deleted under us answers XINFO with an error: that lane reads as empty.
        replies = pipe.execute(raise_on_error=False)
        each = 2 * len(Lane) + 1
        for i, lane in enumerate(Lane):
            states = [_lane_state(replies[p * each + 2 * i], replies[p * each + 2 * i + 1])
                      for p in range(self.partitions.count)]
            read = [state for state in states if state is not None]
            if read:  # a partition's error reply leaves it out of the sum
                self.metrics.stream_state(lane.value, *(sum(x) for x in zip(*read, strict=True)))
        dead = [reply for reply in replies[each - 1::each] if not isinstance(reply, Exception)]
        if dead:
            self.metrics.dead_letters.set(sum(int(n) for n in dead))

    def _sample_gpu(self, memory: Callable[[str], tuple[int, int]]) -> None:
        try:
            self.metrics.gpu_memory(self.device, *memory(self.device))
        except Exception:  # a broken device is the model thread's to report, not ours
            logger.debug("sampling GPU memory failed", exc_info=True)


def _lane_state(length: Any, groups: Any) -> tuple[int, int, int] | None:
    """(length, pending, lag) of one partition's lane; None when its XLEN failed."""
    if isinstance(length, Exception):
        return None
    pending, lag = group_state(groups, int(length))
    return int(length), pending, lag


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
