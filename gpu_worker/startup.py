"""The worker's start-up steps that build a part each: the preprocessing pool with its
shared-memory slots, the model runner (warmed up), and the consumer groups in Redis.

Called in this order by ``Worker.setup`` (loop.py), after the calibration profile has
settled the batch sizes (gpu_worker/tuning/apply.py), which the slots and warm-up depend on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import redis
from redbatch import __version__
from redbatch.common.config import BatchSettings, Settings
from redbatch.common.redis_io import REDIS_ERRORS, Backoff, RedisUnavailable, error_code
from redbatch.gpu_worker import malloc_tuning
from redbatch.gpu_worker.batcher import Batcher, LanePolicy, LatencyEstimator
from redbatch.gpu_worker.capacity import Capacity
from redbatch.gpu_worker.intake import Intake, Job
from redbatch.gpu_worker.metrics import Health, WorkerMetrics
from redbatch.gpu_worker.model import ModelRunner
from redbatch.gpu_worker.tuning.apply import Tuned, warmup_sizes
from redbatch.handlers.base import Handler
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotAllocator, SlotArray, sweep_orphans
from redbatch.preproc_worker.worker import PreprocDone

logger = logging.getLogger(__name__)


def batching(b: BatchSettings, latency: LatencyEstimator, preferred_sizes: tuple[int, ...] = (),
             always_round_up: bool = False) -> tuple[Capacity, Batcher[Job]]:
    """The in-flight places and the batcher for these batch settings; bulk jobs never take
    the places kept for interactive ones (BatchSettings.interactive_reserve)."""
    capacity = Capacity(b.max_inflight, b.max_inflight - b.interactive_reserve)
    lanes = LanePolicy(bulk_max_wait_s=b.bulk_max_wait_ms / 1000, bulk_share=b.bulk_share,
                       bulk_starve_s=b.bulk_starve_ms / 1000,
                       bulk_batch_budget_s=b.bulk_batch_ms / 1000 if b.bulk_batch_ms else None)
    batcher: Batcher[Job] = Batcher(b.max_batch_size, b.max_wait_ms / 1000, latency, lanes,
                                    preferred_sizes, always_round_up)
    return capacity, batcher


def start_pool(s: Settings, handler: Handler,
               on_done: Callable[[PreprocDone], None]) -> tuple[SlotArray, SlotAllocator,
                                                                PreprocPool]:
    """Sweep what dead workers with our prefix left in /dev/shm (NOTE [ Shared-memory
    lifetime ] in shm.py), then create the slots and start the pool processes."""
    sweep_orphans(s.pool.shm_prefix)
    slots = SlotArray.create(s.batch.max_inflight, handler.input_shape, handler.input_dtype,
                             s.pool.shm_prefix)
    pool = PreprocPool(s.model.spec, s.limits, s.pool, slots.layout)
    pool.start(on_done=on_done)
    return slots, SlotAllocator(s.batch.max_inflight), pool


def load_model(s: Settings, tuned: Tuned, handler: Handler, slots: SlotArray,
               latency: LatencyEstimator, metrics: WorkerMetrics) -> ModelRunner:
    """The model runner on the tuned device, warmed up at every size it will run; the
    latency estimator learns the sizes the profile did not measure."""
    assert tuned.device is not None, "tune() chose the device"
    runner = ModelRunner(handler, tuned.device, slots.array, s.batch.max_batch_size,
                         tuned.variant, model=tuned.model,
                         memory_watermark=s.tune.memory_watermark, lanes=tuned.lanes)
    sizes = warmup_sizes(s.batch.max_batch_size, tuned.preferred_sizes, runner.pipelined)
    for size, seconds in runner.warmup(sizes).items():
        if size not in tuned.latency_s:  # measured times from the profile are better
            latency.observe(size, seconds)
    metrics.started(s.consumer, __version__, str(tuned.device), s.pool.processes,
                    s.batch.max_inflight)
    _log_ready(s, tuned, runner)
    return runner


def _log_ready(s: Settings, tuned: Tuned, runner: ModelRunner) -> None:
    import torch

    device = runner.device
    logger.info("model ready: device=%s torch_threads=%d pool=%d max_batch=%d "
                "max_wait_ms=%g variant=%s preferred_batch_sizes=%s", device,
                torch.get_num_threads(), s.pool.processes, s.batch.max_batch_size,
                s.batch.max_wait_ms, tuned.variant.name, list(tuned.preferred_sizes))
    if device.type == "cpu":
        logger.info("cpu path: %d batches at once on %d torch threads each, %d cores, "
                    "beside %d preprocessing processes; %s memory format; %s",
                    runner.depth, torch.get_num_threads(), os.cpu_count() or 1,
                    s.pool.processes, "channels_last" if s.model.channels_last else "NCHW",
                    malloc_tuning.describe())


def wait_for_redis(intake: Intake, health: Health, stop: threading.Event) -> None:
    """Create the consumer groups, waiting out a Redis that is down or refuses them
    (out of memory, a replica, a key of another type where a stream belongs): no crash
    loop, and the worker is not ready meanwhile. Raises RedisUnavailable if ``stop`` is
    set while it waits."""
    backoff = Backoff()
    while True:
        try:
            intake.ensure_groups()
            health.accepted("reads")
            return
        except redis.RedisError as e:
            wait = backoff.next_wait_s()
            if isinstance(e, REDIS_ERRORS):
                logger.warning("Redis not reachable (%s); retrying in %.1fs", e, wait)
            else:
                health.refused("reads", f"{error_code(e)}: {e}")
                logger.error("cannot create the consumer groups on %s (%s); retrying in "
                             "%.1fs", ", ".join(intake.keys.streams()), e, wait)
            if stop.wait(wait):
                raise RedisUnavailable("stopped while waiting for Redis") from e
