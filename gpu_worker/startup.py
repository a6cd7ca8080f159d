"""The worker's start-up, in one phase: :func:`build` makes every part the main loop runs
on, whole, or none of them. In order: each model's handler and calibration profile, which
settles its batch sizes (gpu_worker/tuning/apply.py) that its slots and warm-up depend on;
the preprocessing pool, one for all the models, with each model's shared-memory slots (its
processes start while the models warm up); each model's runner, warmed up one after the
other on the shared device (so each learns its memory with the others' already held); each
model's consumer groups in Redis and its writer. Each part that holds a resource registers
its closing on the caller's ExitStack as soon as it exists, so a failure half-way closes
what was built.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import redis
from redbatch import __version__
from redbatch.common.config import BatchSettings, RedisSettings, Settings
from redbatch.common.protocol import Keys
from redbatch.common.protocol.functions import LIBRARY_NAME, load_library
from redbatch.common.redis_io import REDIS_ERRORS, Backoff, RedisUnavailable, connect, error_code
from redbatch.gpu_worker.batching.batcher import Batcher, LanePolicy, LatencyEstimator
from redbatch.gpu_worker.batching.capacity import Capacity
from redbatch.gpu_worker.batching.shaping import (
    DEFAULT_SMALLEST_EDGE,
    SERVING_EDGES_PER_OCTAVE,
    ShapedBatcher,
    ShapePolicy,
    TokenLatencyEstimator,
    octave_edges,
)
from redbatch.gpu_worker.device import malloc_tuning
from redbatch.gpu_worker.device.runner import ModelRunner
from redbatch.gpu_worker.device.watchdog import Watchdog
from redbatch.gpu_worker.metrics import Health, WorkerMetrics
from redbatch.gpu_worker.outbox import Outbox
from redbatch.gpu_worker.streams.intake import Intake, Job
from redbatch.gpu_worker.streams.results import Answer, ResultWriter
from redbatch.gpu_worker.streams.transaction import ReplicaWait
from redbatch.gpu_worker.tuning.apply import Tuned, warmup_sizes
from redbatch.gpu_worker.tuning.shapes import (
    can_measure,
    longest_inputs,
    measure_shapes,
    shape_grid,
)
from redbatch.handlers.base import Handler, load_handler, max_cost_of, preprocesses_inline
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotAllocator, SlotArray, sweep_orphans
from redbatch.preproc_worker.worker import PreprocDone

logger = logging.getLogger(__name__)


def batching(b: BatchSettings, latency: LatencyEstimator, preferred_sizes: tuple[int, ...] = (),
             always_round_up: bool = False,
             max_cost: int | None = None) -> tuple[Capacity, Batcher[Job]]:
    """The in-flight places and the batcher for these batch settings; bulk jobs never take
    the places kept for interactive ones (BatchSettings.interactive_reserve). A model whose
    inputs cost up to ``max_cost`` (its handler says so) gets length buckets and a token
    budget (a ShapedBatcher) unless ``max_batch_tokens`` is 0."""
    capacity = Capacity(b.max_inflight, b.max_inflight - b.interactive_reserve,
                        group=b.max_batch_size)
    lanes = LanePolicy(bulk_max_wait_s=b.bulk_max_wait_ms / 1000, bulk_share=b.bulk_share,
                       bulk_starve_s=b.bulk_starve_ms / 1000,
                       bulk_batch_budget_s=b.bulk_batch_ms / 1000 if b.bulk_batch_ms else None)
    if max_cost and b.max_batch_tokens:
        edges = octave_edges(max_cost, min(DEFAULT_SMALLEST_EDGE, max_cost),
                             SERVING_EDGES_PER_OCTAVE)
        shaped: Batcher[Job] = ShapedBatcher(
            b.max_batch_size, b.max_wait_ms / 1000, ShapePolicy(b.max_batch_tokens, edges),
            TokenLatencyEstimator(), latency, lanes, preferred_sizes, always_round_up)
        return capacity, shaped
    batcher: Batcher[Job] = Batcher(b.max_batch_size, b.max_wait_ms / 1000, latency, lanes,
                                    preferred_sizes, always_round_up)
    return capacity, batcher


def tune(s: Settings, handler: Handler,
         latency: LatencyEstimator) -> tuple[Tuned, Capacity, Batcher[Job]]:
    """Threads, device, model and calibration profile (gpu_worker/tuning/apply.py), and the
    batching pieces rebuilt for the batch sizes they settled; the latency estimator starts
    from the profile's measured times."""
    from redbatch.gpu_worker.tuning.apply import tune as apply_profile

    tuned = apply_profile(s, handler)
    for note in tuned.notes:
        logger.info("tuning: %s", note)
    capacity, batcher = batching(tuned.settings.batch, latency, tuned.preferred_sizes,
                                 tuned.always_round_up, max_cost_of(handler))
    latency.seed(tuned.latency_s)
    return tuned, capacity, batcher


@dataclass(frozen=True, slots=True)
class Served:
    """One model of the worker, with every part that is its own: its streams' intake and
    writer, its batcher and in-flight places, its slots and its runner on the shared device."""

    #: Its place among the worker's models (Settings.models), which jobs and events carry.
    index: int
    #: Its settings, as its calibration profile settled them.
    settings: Settings
    tuned: Tuned
    latency: LatencyEstimator
    metrics: WorkerMetrics
    capacity: Capacity
    batcher: Batcher[Job]
    slots: SlotArray
    allocator: SlotAllocator
    runner: ModelRunner
    #: The handler, when its preprocessing is trivial enough to run in the main loop.
    inline: Handler | None
    intake: Intake
    writer: ResultWriter
    #: Groups of answers for its writer thread, from its outbox.
    outgoing: queue.SimpleQueue[list[Answer] | None]
    outbox: Outbox

    @property
    def name(self) -> str:
        return self.settings.model.served_name


@dataclass(frozen=True, slots=True)
class Parts:
    """Everything the main loop runs on, as :func:`build` made it."""

    #: The worker's settings, the pool's processes resolved.
    settings: Settings
    pool: PreprocPool
    #: The models, in the order of Settings.models.
    models: list[Served]


@dataclass(slots=True)
class _Tuning:
    """One model's parts settled before the pool and the runners start."""

    handler: Handler
    tuned: Tuned
    capacity: Capacity
    batcher: Batcher[Job]
    latency: LatencyEstimator = field(default_factory=LatencyEstimator)


def build(s: Settings, metrics: WorkerMetrics, health: Health,
          on_records: Callable[[list[PreprocDone]], None], stop: threading.Event,
          stack: ExitStack) -> Parts:
    """Every part, in the order of the module's docstring, for each model; what holds a
    resource closes with ``stack``. Raises ValueError for a bad model or device,
    RedisUnavailable when ``stop`` is set while Redis is awaited."""
    tunings = [_tune_one(s, i) for i in range(len(s.models))]
    s = _shared(s, tunings)
    settings = [replace(t.tuned.settings, pool=s.pool) for t in tunings]
    slots, pool = start_pool(s, [(t.handler, each) for t, each in zip(tunings, settings,
                                                                        strict=True)],
                             on_records, stack)
    runners = []
    for t, each, its_slots, its_metrics in zip(tunings, settings, slots,
                                               _metrics(metrics, settings), strict=True):
        its_metrics.max_batch_size = each.batch.max_batch_size
        runner = load_model(each, t.tuned, t.handler, its_slots, t.latency, its_metrics)
        stack.callback(runner.close)
        if isinstance(t.batcher, ShapedBatcher) and each.tune.calibrate != "off":
            seed_shapes(t.batcher, t.handler, runner, its_slots, each.warmup_timeout_s)
        runners.append((runner, its_metrics))
    health.model_loaded = True
    models = []
    for i, (t, each, its_slots, (runner, its_metrics)) in enumerate(
            zip(tunings, settings, slots, runners, strict=True)):
        intake, writer = connect_model(each, its_metrics, health, stop)
        outgoing: queue.SimpleQueue[list[Answer] | None] = queue.SimpleQueue()
        models.append(Served(
            i, each, t.tuned, t.latency, its_metrics, t.capacity, t.batcher, its_slots,
            SlotAllocator(each.batch.max_inflight), runner,
            t.handler if preprocesses_inline(t.handler) else None, intake, writer, outgoing,
            Outbox(health, outgoing.put)))
    return Parts(s, pool, models)


def _tune_one(s: Settings, index: int) -> _Tuning:
    """The ``index``-th model's handler, profile and batching pieces."""
    handler = load_handler(s.models[index].spec, s.limits)
    latency = LatencyEstimator()
    tuned, capacity, batcher = tune(s.for_model(index), handler, latency)
    return _Tuning(handler, tuned, capacity, batcher, latency)


def _shared(s: Settings, tunings: list[_Tuning]) -> Settings:
    """The worker's settings with the pool sized as the first model's tuning resolved it
    (the same for each: one device, one rule), or with no process when every model
    preprocesses in the main loop."""
    pool = tunings[0].tuned.settings.pool
    if all(preprocesses_inline(t.handler) for t in tunings):
        pool = replace(pool, processes=0)
    return replace(s, pool=pool)


def _metrics(first: WorkerMetrics, settings: list[Settings]) -> list[WorkerMetrics]:
    """Each model's metrics: the first model's are the worker's, the others share them."""
    return [first if i == 0 else first.for_model(each.model.served_name,
                                                  each.batch.max_batch_size)
            for i, each in enumerate(settings)]


def connect_model(s: Settings, metrics: WorkerMetrics, health: Health,
                  stop: threading.Event, charges: bool = False) -> tuple[Intake, ResultWriter]:
    """A model's intake, once its consumer groups exist, and its result writer (which
    deletes each answered entry's charge when ``charges``: a generation model)."""
    r = connect_waiting(s.redis, stop)
    intake = Intake(r, Keys(s.model.served_name, s.redis.prefix), s.consumer,
                    s.limits.max_payload_bytes, s.reclaim_idle_ms, s.max_deliveries)
    wait_for_redis(intake, health, stop)
    load_functions(r)
    wait = ReplicaWait(s.result_replicas, s.result_wait_ms) if s.result_replicas else None
    writer = ResultWriter(connect(s.redis), intake.keys, s.consumer, s.result_ttl_s, wait,
                          metrics.result_waited, charges)
    return intake, writer


def start_pool(s: Settings, models: list[tuple[Handler, Settings]],
               on_records: Callable[[list[PreprocDone]], None],
               stack: ExitStack) -> tuple[list[SlotArray], PreprocPool]:
    """Sweep what dead workers with our prefix left in /dev/shm (NOTE [ Shared-memory
    lifetime ] in shm.py), then create each model's slots and start the pool's processes,
    which preprocess for every model."""
    sweep_orphans(s.pool.shm_prefix)
    slots = []
    for handler, each in models:
        array = SlotArray.create(each.batch.max_inflight, handler.input_shape,
                                 handler.input_dtype, s.pool.shm_prefix)
        stack.callback(array.close)  # last: the pool's processes and the model use the slots
        slots.append(array)
    specs = [(each.model.spec, array.layout) for (_, each), array in zip(models, slots,
                                                                          strict=True)]
    pool = PreprocPool(specs[0][0], s.limits, s.pool, specs[0][1], more=specs[1:])
    stack.callback(pool.close)
    pool.start(on_records=on_records)
    return slots, pool


def load_model(s: Settings, tuned: Tuned, handler: Handler, slots: SlotArray,
               latency: LatencyEstimator, metrics: WorkerMetrics) -> ModelRunner:
    """The model runner on the tuned device, warmed up at every size it will run; the
    latency estimator learns the sizes the profile did not measure."""
    assert tuned.device is not None, "tune() chose the device"
    model, variant = tuned.model, tuned.variant
    if tuned.package is not None and model is not None:
        from redbatch.gpu_worker.device.packaged import package_or_none

        packaged, note = package_or_none(model, variant, handler.input_shape,
                                         handler.input_dtype, s.batch.max_batch_size,
                                         tuned.device, tuned.package, tuned.lanes)
        if packaged is not None:
            logger.info("tuning: %s", note)
            model = packaged
            variant = replace(variant, compile=False)  # the package is the compiled model
        else:  # torch.compile; batches run at the warmed-up sizes (ModelRunner pads)
            logger.warning("tuning: %s", note)
    runner = ModelRunner(handler, tuned.device, slots.array, s.batch.max_batch_size,
                         variant, model=model,
                         memory_watermark=s.tune.memory_watermark, lanes=tuned.lanes)
    sizes = warmup_sizes(s.batch.max_batch_size, tuned.preferred_sizes, runner.pipelined)
    # A hung warm-up ends the worker with code 3 (NOTE [ Device watchdog ]).
    with longest_inputs(handler, slots.array, s.batch.max_batch_size), \
            Watchdog(s.warmup_timeout_s) as dog:
        warm = runner.warmup(sizes, dog.watch)
    for size, seconds in warm.items():
        if size not in tuned.latency_s:  # measured times from the profile are better
            latency.observe(size, seconds)
    metrics.started(s.consumer, __version__, str(tuned.device), s.pool.processes,
                    s.batch.max_inflight)
    _log_ready(s, tuned, runner)
    return runner


def seed_shapes(batcher: ShapedBatcher[Job], handler: Handler, runner: ModelRunner,
                slots: SlotArray, timeout_s: float) -> None:
    """Time a few (rows, padded length) shapes on the model and start the batcher's run-time
    line from them (gpu_worker/tuning/shapes.py), before any job is read; a shape's runs
    taking over ``timeout_s`` end the worker (code 3)."""
    if not can_measure(handler):
        return
    grid = shape_grid(batcher.max_batch_size, batcher.shape.edges[-1],
                      batcher.shape.max_batch_tokens)
    with Watchdog(timeout_s) as dog:
        seconds = measure_shapes(handler, runner, slots.array, grid, dog.watch)
    batcher.seed(seconds)
    a, b = batcher.token_run_time(0, 0), batcher.token_run_time(1, 1000) - \
        batcher.token_run_time(0, 0)
    logger.info("tuning: %d text batch shapes timed (rows x length up to %s): a batch takes "
                "about %.1f ms + %.1f ms per 1000 padded tokens", len(seconds),
                max(r * n for r, n in grid), a * 1000, b * 1000)


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


def connect_waiting(settings: RedisSettings, stop: threading.Event) -> redis.Redis:
    """:func:`connect`, waiting out a cluster none of whose nodes answers yet (a cluster
    client reads the slot map when it is made; a plain one connects on its first call).
    Raises RedisUnavailable if ``stop`` is set while it waits."""
    backoff = Backoff()
    while True:
        try:
            return connect(settings)
        except REDIS_ERRORS as e:
            wait = backoff.next_wait_s()
            logger.warning("Redis not reachable (%s); retrying in %.1fs", e, wait)
            if stop.wait(wait):
                raise RedisUnavailable("stopped while waiting for Redis") from e


def load_functions(r: redis.Redis) -> None:
    """Load the protocol's function library (PROTOCOL.md "The function library"), on a
    cluster on every master, so that producers, who may not load it, can submit. A refusal
    (a worker user made before the library, without FUNCTION LOAD) or a lost Redis is one
    warning: the worker serves what is queued either way."""
    try:
        load_library(r)
    except redis.RedisError as e:
        logger.warning("cannot load the function library %s (%s): producers that may not "
                       "load it get functions_missing until it is loaded (`redbatch acl "
                       "--apply` does)", LIBRARY_NAME, str(e)[:120])


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
