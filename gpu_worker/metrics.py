"""Every Prometheus metric of a worker, and the HTTP server for /metrics, /healthz, /readyz.

The metric contract (docs/operations.md "Metrics and health"; the Grafana dashboard and the
Prometheus config use these names). Every metric has the label ``model``; others are listed. Gauges
marked "sampled" are refreshed every 1-2 s; everything else is recorded as it happens.

  counters
  redbatch_requests_total                lane, outcome      a result written
  redbatch_executions_total                                 a batch run
  redbatch_inferences_total                                 a batch run (+ its size)
  redbatch_batch_tokens_total            kind               a batch of a model with costs
                                                            (text: tokens): real, padded
  redbatch_dead_lettered_total                              an entry put in the DLQ
  redbatch_reclaimed_total                                  a job taken over
  redbatch_result_waits_total            outcome            a write of results followed
                                                            by WAIT (--result-replicas):
                                                            acked, or short (timed out
                                                            or failed: not confirmed)
  histograms, seconds
  redbatch_queue_seconds                 lane               ok result: time in Redis
  redbatch_preprocess_seconds                               ok result: decode in the pool
  redbatch_batch_wait_seconds                               ok result: waiting for its batch
  redbatch_request_seconds               lane               ok result: end to end
  redbatch_inference_seconds                                a batch run: its run time
  redbatch_batch_size                                       a batch run: requests in it
  redbatch_batch_fill_ratio                                 a batch run: size / largest
  gauges
  redbatch_inflight_requests                                sampled: read, not answered
  redbatch_pool_processes                                   at start
  redbatch_pool_busy_processes                              sampled
  redbatch_shm_slots                                        at start (= most in flight)
  redbatch_shm_slots_in_use                                 sampled
  redbatch_stream_length                 lane               sampled from Redis
  redbatch_stream_pending                lane               sampled from Redis
  redbatch_stream_lag                    lane               sampled from Redis
  redbatch_dead_letters                                     sampled from Redis
  redbatch_gpu_memory_allocated_bytes    device             sampled, CUDA only
  redbatch_gpu_memory_reserved_bytes     device             sampled, CUDA only
  redbatch_worker_info (always 1)        version, device, max_batch_size, consumer

``outcome`` is ``ok`` or the error code of the result (``expired``, ``bad_image``, ...).
Latency histograms hold ok results only, so an error answered in a millisecond does not
pull the percentiles down. Mean batch size is ``rate(inferences) / rate(executions)``,
as with Triton. Stream and dead-letter gauges describe Redis, not this worker: every
worker reports the same values, so aggregate them with ``max``.

Why no multi-process registry: pool processes measure their decode time and send it back
with each record, so only the worker process records metrics. The registry is the
worker's own (not prometheus_client's global one), so a process may hold several.

The module runs past 400 lines because it is the contract's one home: every series is
declared here, beside the few functions that record a group at once and serve them.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
import time
from bisect import bisect_left
from collections import Counter as CountOf
from collections.abc import Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from redbatch.common.protocol import Lane, Status

logger = logging.getLogger(__name__)

#: Latency buckets, seconds: a millisecond stage to half a minute in a queue.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 30.0)
#: The same for every worker, whatever its largest batch, so fleets aggregate.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FILL_BUCKETS = (0.125, 0.25, 0.5, 0.75, 1.0)
#: Stage in the result timings (ms) -> (histogram, whether it has the lane label).
_STAGES = {"queue_ms": ("queue", True), "preprocess_ms": ("preprocess", False),
           "batch_wait_ms": ("batch_wait", False), "total_ms": ("request", True)}
_STAGE_DOCS = {"queue": "Time in the Redis stream before a worker read it",
               "preprocess": "Decode and preprocessing time in the pool",
               "batch_wait": "Time a preprocessed request waited for its batch to run",
               "request": "End to end: Redis accepted the job to its result written"}


#: One answered entry, as :meth:`WorkerMetrics.answered` takes it: lane, outcome (``ok`` or
#: an error code), the result's timings in ms (or None), whether it was dead-lettered.
Answered = tuple[str, str, Mapping[str, float] | None, bool]


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """Observe each of ``values`` in one labelled histogram series, as ``observe`` would
    one by one, with one locked increment per bucket touched and one for the sum (where
    ``observe`` takes two per value). It reaches into prometheus_client's series
    (``_upper_bounds``, ``_buckets``, ``_sum``, as 0.2x lays them out), which
    tests/test_metrics.py checks against ``observe``; a series without them is fed value by
    value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for value in values:
            histogram.observe(value)
        return
    for index, n in CountOf(bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(n)  # bounds end with +Inf: every value has a bucket
    total.inc(sum(values))


class WorkerMetrics:
    """The metrics of one model of a worker, on the worker's own registry. Thread-safe
    (prometheus_client locks). A worker serving several models makes one with
    :meth:`for_model` for each of the others: the same series, labelled with its name."""

    def __init__(self, model: str, max_batch_size: int) -> None:
        # The *_created series would double the series count and no dashboard uses them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self._declare_requests()
        self._declare_batches()
        self._declare_state()
        #: The GPU memory gauges, made on the first CUDA start (shared by for_model copies).
        self._gpu: list[Gauge] = []
        self._bind(model, max_batch_size)

    def for_model(self, model: str, max_batch_size: int) -> WorkerMetrics:
        """The metrics of another model served by the same worker: the same registry and
        series, labelled ``model``."""
        other = copy.copy(self)
        other._bind(model, max_batch_size)
        return other

    # ------------------------------------------------------------------ declarations

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, ["model", *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, ["model", *labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...],
                   labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, doc, ["model", *labels], buckets=buckets, registry=self.registry)

    def _declare_requests(self) -> None:
        self.requests = self._counter("redbatch_requests_total",
                                      "Results written, by lane and outcome (ok or error code).",
                                      ("lane", "outcome"))
        self.stages = {stage: self._histogram(f"redbatch_{stage}_seconds",
                                              f"{_STAGE_DOCS[stage]}, ok results, s.",
                                              LATENCY_BUCKETS_S, ("lane",) if by_lane else ())
                       for stage, by_lane in _STAGES.values()}
        self._dead_lettered = self._counter("redbatch_dead_lettered_total", "Entries this "
                                            "worker put in the dead-letter stream.")
        self._reclaimed = self._counter(
            "redbatch_reclaimed_total", "Jobs delivered before, taken over from a dead or "
            "stuck worker (or re-read after a restart under the same consumer name).")
        self._waits = self._counter("redbatch_result_waits_total", "Writes of results "
                                    "followed by WAIT (--result-replicas): confirmed by as "
                                    "many replicas as asked (acked), or not (short: timed "
                                    "out or failed).", ("outcome",))

    def _declare_batches(self) -> None:
        self._executions = self._counter("redbatch_executions_total", "Batches run by the model.")
        self._inferences = self._counter("redbatch_inferences_total",
                                         "Requests run by the model, over all batches.")
        self._inference_s = self._histogram("redbatch_inference_seconds", "Model run time of "
                                            "one batch, s.", LATENCY_BUCKETS_S)
        self._tokens = self._counter("redbatch_batch_tokens_total", "Tokens (inputs' costs) "
                                     "run by the model: real ones, and padded (rows x the "
                                     "longest); padded / real is the padding waste.", ("kind",))
        self._batch_size = self._histogram("redbatch_batch_size", "Requests per batch.",
                                           BATCH_SIZE_BUCKETS)
        self._batch_fill = self._histogram("redbatch_batch_fill_ratio", "Batch size over the "
                                           "largest batch.", FILL_BUCKETS)

    def _declare_state(self) -> None:
        self._inflight = self._gauge("redbatch_inflight_requests",
                                     "Jobs read from Redis and not yet answered.")
        self._pool_processes = self._gauge("redbatch_pool_processes", "Preprocessing processes.")
        self._pool_busy = self._gauge("redbatch_pool_busy_processes",
                                      "Preprocessing processes working on a job.")
        self._shm_slots = self._gauge("redbatch_shm_slots",
                                      "Shared-memory slots (= most jobs in flight).")
        self._shm_in_use = self._gauge("redbatch_shm_slots_in_use",
                                       "Shared-memory slots holding a job.")
        self.stream_length = self._gauge("redbatch_stream_length", "Entries in the lane's "
                                         "stream: queued or in progress.", ("lane",))
        self.stream_pending = self._gauge("redbatch_stream_pending", "Entries read by a worker "
                                          "and not yet answered.", ("lane",))
        self.stream_lag = self._gauge("redbatch_stream_lag",
                                      "Entries no worker has read yet.", ("lane",))
        self._dead_letters = self._gauge("redbatch_dead_letters",
                                         "Entries in the dead-letter stream.")
        self.info = Info("redbatch_worker", "The worker's version, device and largest batch.",
                         ["model"], registry=self.registry)

    def _bind(self, model: str, max_batch_size: int) -> None:
        """This model's series of every family, made now so that rate() works from the
        first job, and kept so that recording never looks a label up."""
        self.model, m = model, model
        self.max_batch_size = max_batch_size
        #: Labelled series answered() uses for every job, by (lane, outcome) and by lane.
        self._requests: dict[tuple[str, str], Any] = {}
        self._stage_series: dict[str, list[tuple[str, Any]]] = {}
        self.dead_lettered = self._dead_lettered.labels(m)
        self.reclaimed_jobs = self._reclaimed.labels(m)
        self.result_waits = {"acked": self._waits.labels(m, "acked"),
                             "short": self._waits.labels(m, "short")}
        for lane in Lane:
            self.requests.labels(m, lane.value, Status.OK.value)
            for gauge in (self.stream_length, self.stream_pending, self.stream_lag):
                gauge.labels(m, lane.value)
        for stage, by_lane in _STAGES.values():
            for labels in ([(m, lane.value) for lane in Lane] if by_lane else [(m,)]):
                self.stages[stage].labels(*labels)
        self.executions, self.inferences = self._executions.labels(m), self._inferences.labels(m)
        self.inference_s = self._inference_s.labels(m)
        self.real_tokens, self.padded_tokens = self._tokens.labels(m, "real"), \
            self._tokens.labels(m, "padded")
        self.batch_size, self.batch_fill = self._batch_size.labels(m), self._batch_fill.labels(m)
        self.inflight, self.pool_processes = self._inflight.labels(m), \
            self._pool_processes.labels(m)
        self.pool_busy, self.shm_slots = self._pool_busy.labels(m), self._shm_slots.labels(m)
        self.shm_in_use, self.dead_letters = self._shm_in_use.labels(m), \
            self._dead_letters.labels(m)

    # ------------------------------------------------------------------ recording

    def started(self, consumer: str, version: str, device: str, pool_processes: int,
                shm_slots: int) -> None:
        """The model is loaded on ``device``: set the fixed values (GPU gauges on CUDA)."""
        self.info.labels(self.model).info({"version": version, "device": device,
                                           "max_batch_size": str(self.max_batch_size),
                                           "consumer": consumer})
        self.pool_processes.set(pool_processes)
        self.shm_slots.set(shm_slots)
        if device.startswith("cuda") and not self._gpu:
            self._gpu.extend((self._gauge("redbatch_gpu_memory_allocated_bytes",
                                          "GPU memory held by tensors, bytes.", ("device",)),
                              self._gauge("redbatch_gpu_memory_reserved_bytes",
                                          "GPU memory reserved by torch's allocator, bytes.",
                                          ("device",))))

    def answered(self, answers: Iterable[Answered]) -> None:
        """A group of entries answered, each ``(lane, outcome, timings in ms, whether it was
        dead-lettered)`` (``outcome``: ``ok`` or an error code). One increment per counter
        series and one :func:`observe_many` per histogram series for the whole group, not
        one locked update per job; the labelled series are looked up once and kept."""
        counts: CountOf[tuple[str, str]] = CountOf()
        seconds: dict[str, dict[str, list[float]]] = {}  # lane -> timing field -> values
        dead = 0
        for lane, outcome, timings, dead_lettered in answers:
            counts[(lane, outcome)] += 1
            dead += dead_lettered
            if outcome == Status.OK.value and timings:
                by_field = seconds.get(lane)
                if by_field is None:
                    by_field = seconds[lane] = {field: [] for field in _STAGES}
                for field, values in by_field.items():
                    if field in timings:
                        values.append(timings[field] / 1000)
        for key, n in counts.items():
            counter = self._requests.get(key)
            if counter is None:
                counter = self._requests[key] = self.requests.labels(self.model, *key)
            counter.inc(n)
        if dead:
            self.dead_lettered.inc(dead)
        for lane, by_field in seconds.items():
            for field, histogram in self._stages_of(lane):
                if by_field[field]:
                    observe_many(histogram, by_field[field])

    def _stages_of(self, lane: str) -> list[tuple[str, Any]]:
        """(timing field, its histogram series) for results of ``lane``, looked up once."""
        series = self._stage_series.get(lane)
        if series is None:
            series = self._stage_series[lane] = [
                (field, self.stages[stage].labels(*((self.model, lane) if by_lane
                                                    else (self.model,))))
                for field, (stage, by_lane) in _STAGES.items()]
        return series

    def batch(self, size: int, seconds: float) -> None:
        """One model execution of ``size`` requests that took ``seconds``."""
        self.executions.inc()
        self.inferences.inc(size)
        self.inference_s.observe(seconds)
        self.batch_size.observe(size)
        self.batch_fill.observe(size / self.max_batch_size)

    def tokens(self, costs: Sequence[tuple[int, int]]) -> None:
        """The (cost, rows) of one batch's inputs (tokens: the longest text's, and the texts
        it holds), whose rows ran padded to the batch's longest. An input of several rows
        counts its longest for each (an upper bound of its real tokens)."""
        longest = max((cost for cost, _ in costs), default=0)
        if longest > 0:
            self.real_tokens.inc(sum(cost * rows for cost, rows in costs))
            self.padded_tokens.inc(sum(rows for _, rows in costs) * longest)

    def result_waited(self, replication: Any) -> None:
        """One WAIT after a write of results (gpu_worker/streams/transaction.py ``Replication``)."""
        self.result_waits["short" if replication.short else "acked"].inc()

    def reclaimed(self, n: int) -> None:
        if n:
            self.reclaimed_jobs.inc(n)

    def loop_state(self, inflight: int, shm_in_use: int, pool_busy: int) -> None:
        self.inflight.set(inflight)
        self.shm_in_use.set(shm_in_use)
        self.pool_busy.set(pool_busy)

    def stream_state(self, lane: str, length: int, pending: int, lag: int) -> None:
        self.stream_length.labels(self.model, lane).set(length)
        self.stream_pending.labels(self.model, lane).set(pending)
        self.stream_lag.labels(self.model, lane).set(lag)

    def gpu_memory(self, device: str, allocated: int, reserved: int) -> None:
        if self._gpu:
            self._gpu[0].labels(self.model, device).set(allocated)
            self._gpu[1].labels(self.model, device).set(reserved)


class Health:
    """What /healthz and /readyz answer. Written by the worker's threads, read by the HTTP
    thread; each change is one assignment or one dict operation (atomic under the GIL), so
    no lock is needed."""

    def __init__(self, stall_s: float = 60.0, redis_stale_s: float = 10.0) -> None:
        #: The main loop has not stepped for this long: it hangs (it wakes at least every
        #: 0.2 s), so /healthz fails and a supervisor may restart the worker.
        self.stall_s = stall_s
        #: No successful Redis round trip for this long: not ready.
        self.redis_stale_s = redis_stale_s
        self.model_loaded = False
        self.stopping = False
        self._stepped_at: float | None = None  # None while starting: loading is not a hang
        self._redis_ok_at = float("-inf")
        #: What Redis refuses this worker now, by who asked (writes, reads, heartbeat):
        #: Redis answers, but a worker that cannot write its results is not ready.
        self._refused: dict[str, str] = {}

    def stepped(self) -> None:
        self._stepped_at = time.monotonic()

    def redis_reached(self) -> None:
        self._redis_ok_at = time.monotonic()

    def refused(self, source: str, reason: str) -> None:
        """Redis refused ``source``'s commands (OOM, READONLY, NOPERM...): not ready."""
        self._refused[source] = reason

    def accepted(self, source: str) -> None:
        """``source``'s commands go through again."""
        self._refused.pop(source, None)

    def alive(self) -> tuple[bool, str]:
        stepped = self._stepped_at
        if stepped is not None and time.monotonic() - stepped > self.stall_s:
            return False, f"main loop stalled for {time.monotonic() - stepped:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if self.stopping:
            return False, "stopping"
        if not self.model_loaded:
            return False, "model loading"
        if time.monotonic() - self._redis_ok_at > self.redis_stale_s:
            return False, "Redis not reachable"
        refused = dict(self._refused)  # a copy: other threads add and remove sources
        if refused:
            return False, "Redis refuses " + "; ".join(f"{source}: {reason}"
                                                       for source, reason in refused.items())
        return True, "ok"


class MetricsServer:
    """/metrics, /healthz (alive) and /readyz (model loaded, Redis reachable) on a daemon
    thread; each request is answered from memory, never by calling Redis."""

    def __init__(self, metrics: WorkerMetrics, health: Health) -> None:
        self.metrics = metrics
        self.health = health
        self._server: ThreadingHTTPServer | None = None

    def start(self, host: str, port: int) -> bool:
        """Listen on ``host:port``; False (logged) when it cannot, e.g. the port is taken:
        a worker without metrics still serves jobs."""
        try:
            server = _Server((host, port), _Handler)
        except OSError as e:
            logger.error("metrics server not started: cannot listen on %s:%d: %s "
                         "(set --metrics-port; 0 disables it)", host, port, e)
            return False
        server.endpoints = self
        self._server = server
        threading.Thread(target=server.serve_forever, name="redbatch-metrics",
                         daemon=True).start()
        logger.info("metrics and health on http://%s:%d/metrics", host, self.port)
        return True

    @property
    def port(self) -> int:
        """The port listened on (the chosen one when started with port 0)."""
        assert self._server is not None
        return int(self._server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry)
        probes = {"/healthz": self.health.alive, "/readyz": self.health.ready}
        if path not in probes:
            return 404, "text/plain", b"not found: try /metrics, /healthz or /readyz\n"
        ok, reason = probes[path]()
        return 200 if ok else 503, "text/plain", f"{reason}\n".encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    endpoints: MetricsServer

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in address[0]:  # an IPv6 host such as "::"
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._answer(body_too=True)

    def do_HEAD(self) -> None:
        """As GET, headers only (a load balancer's or curl -I's probe)."""
        self._answer(body_too=False)

    def _answer(self, body_too: bool) -> None:
        status, content_type, body = self.server.endpoints.respond(self.path.split("?", 1)[0])
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body_too:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # One line per scrape every few seconds would drown the worker's log.
        logger.debug("metrics: " + format, *args)
