"""The fleet at a glance: queues, workers and recent results of every model, read from Redis.

``redbatch status`` and ``redbatch top`` show what :func:`gather` returns; the figures
come from the streams themselves (XLEN, XINFO GROUPS), the dead-letter stream, the
workers' heartbeats and the recent-results list ("Fleet status keys" in PROTOCOL.md),
each summed over the model's partitions (PROTOCOL.md "Partitions"), whose own figures
are kept too. Reading is one round trip for every model's partition count, then two per
model (every partition's figures in one pipeline, the workers' records), and writes nothing.

Times are compared with Redis's clock (TIME), so the machine running ``status`` may
be anywhere; heartbeat ages and the throughput window assume the workers' clocks
agree with Redis's (NTP), as deadlines elsewhere do not need to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from redbatch.common.protocol import (
    GROUP,
    RECENT_MAX,
    DeadLetters,
    Keys,
    Lane,
    ProtocolError,
    RecentResult,
    WorkerRecord,
    job_stream_pattern,
    parse_job_stream,
    parse_partition_history,
)

#: Results per second and latency percentiles are taken over this many seconds.
WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class LaneStatus:
    lane: str
    length: int
    """Entries in the lane's stream: jobs queued or being worked on."""
    pending: int
    """Jobs read by a worker and not yet answered."""
    lag: int
    """Jobs no worker has read yet."""
    results: int
    """Results written in the window."""
    errors: int
    """Of those, error results."""
    results_per_s: float
    p50_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    consumer: str
    alive: bool
    """Its record still exists: it beat within the last three heartbeats."""
    last_seen_ms: int
    heartbeat_age_s: float
    record: WorkerRecord | None
    """What it said about itself; None once it is gone (or written by an unknown version)."""


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    """One partition's own figures (PROTOCOL.md "Partitions"): its lanes and dead letters."""

    partition: int
    dead_letters: int
    lanes: list[LaneStatus]


@dataclass(frozen=True, slots=True)
class ModelStatus:
    model: str
    dead_letters: int
    """Summed over the model's partitions, as are the lanes' figures."""
    workers: list[WorkerStatus]
    lanes: list[LaneStatus]
    partitions: int = 1
    """The model's partition count now."""
    by_partition: list[PartitionStatus] = field(default_factory=list)
    """Each partition's figures, with several partitions (empty with one)."""

    @property
    def workers_alive(self) -> int:
        return sum(w.alive for w in self.workers)


@dataclass(frozen=True, slots=True)
class FleetStatus:
    prefix: str
    now_ms: int
    """Redis's clock when the figures were read, Unix ms."""
    window_s: float
    models: list[ModelStatus]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (what ``status --json`` prints)."""
        out = asdict(self)
        for model, status in zip(out["models"], self.models, strict=True):
            model["workers_alive"] = status.workers_alive
        return out


def discover_models(r: redis.Redis, prefix: str) -> list[str]:
    """Models that have job streams under ``prefix``, sorted (one SCAN of the key space)."""
    found = set()
    for key in r.scan_iter(match=job_stream_pattern(prefix), count=1000, _type="stream"):
        parsed = parse_job_stream(prefix, key.decode(errors="replace"))
        if parsed is not None:
            found.add(parsed[0])
    return sorted(found)


def gather(r: redis.Redis, prefix: str, models: Sequence[str] | None = None,
           window_s: float = WINDOW_S) -> FleetStatus:
    """Read the status of ``models`` (default: every model found under ``prefix``).

    Raises redis.ConnectionError / TimeoutError when Redis cannot be reached.
    """
    seconds, micros = r.time()
    now_ms = seconds * 1000 + micros // 1000
    names = list(models) if models else discover_models(r, prefix)
    counts = _partition_counts(r, [Keys(m, prefix) for m in names])
    return FleetStatus(prefix, now_ms, window_s,
                       [_model_status(r, Keys(m, prefix), count, now_ms, window_s)
                        for m, count in zip(names, counts, strict=True)])


def _partition_counts(r: redis.Redis, models: Sequence[Keys]) -> list[int]:
    """Each model's partition count, in one pipelined round trip (1 when unreadable)."""
    if not models:
        return []
    pipe = r.pipeline(transaction=False)
    for keys in models:
        pipe.lrange(keys.partitions(), 0, -1)
    replies = _raise_lost(pipe.execute(raise_on_error=False))
    return [parse_partition_history(None if isinstance(raw, Exception) else raw)[-1]
            for raw in replies]


def _raise_lost(replies: list[Any]) -> list[Any]:
    """The replies, unless one says Redis could not be reached (raised then)."""
    for reply in replies:
        if isinstance(reply, (redis.ConnectionError, redis.TimeoutError)):
            raise reply
    return replies


#: Replies per partition in _model_status's pipeline: XLEN and XINFO GROUPS per lane,
#: the dead letters' XLEN, the recent results' LRANGE.
_PER_PARTITION = 2 * len(Lane) + 2


def _model_status(r: redis.Redis, keys: Keys, count: int, now_ms: int,
                  window_s: float) -> ModelStatus:
    """One model's figures: every partition's in one pipeline (on a cluster, redis-py sends
    each command to its partition's master), then the live workers' records."""
    pipe = r.pipeline(transaction=False)
    for part in keys.parts(count):
        for stream in part.streams():
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)  # an error reply while the stream does not exist
        DeadLetters(part).length(pipe)
        pipe.lrange(part.recent(), 0, RECENT_MAX - 1)
    pipe.zrange(keys.workers(), 0, -1, withscores=True)
    *per_part, members = _raise_lost(pipe.execute(raise_on_error=False))
    parts: list[PartitionStatus] = []
    records: list[RecentResult] = []
    for p in range(count):
        *per_lane, dlq_len, recent = per_part[p * _PER_PARTITION:(p + 1) * _PER_PARTITION]
        mine = _decode_recent(recent)
        records += mine
        parts.append(PartitionStatus(p, _int(dlq_len), [
            _lane_status(lane, per_lane[2 * i], per_lane[2 * i + 1], mine, now_ms, window_s)
            for i, lane in enumerate(Lane)]))
    lanes = [_lane_total(lane, [part.lanes[i] for part in parts], records, now_ms, window_s)
             for i, lane in enumerate(Lane)]
    return ModelStatus(keys.model, sum(part.dead_letters for part in parts),
                       _workers(r, keys, members, now_ms), lanes, count,
                       parts if count > 1 else [])


def _int(reply: Any) -> int:
    return reply if isinstance(reply, int) else 0


def _lane_status(lane: Lane, length: Any, groups: Any, records: list[RecentResult],
                 now_ms: int, window_s: float) -> LaneStatus:
    """One partition's lane (the model's, with one partition)."""
    length = _int(length)
    group = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), None) \
        if isinstance(groups, list) else None
    pending = int(group["pending"]) if group else 0
    lag = group.get("lag") if group else None
    if lag is None:
        # Redis < 7, or a lag Redis cannot tell after deletions: workers delete every
        # answered entry, so what is in the stream and not pending is what nobody read.
        lag = max(0, length - pending)
    done, per_s = _window([x for x in records if x.lane is lane], now_ms, window_s)
    p50, p99 = _latencies(done)
    return LaneStatus(lane.value, length, pending, int(lag), len(done),
                      sum(x.outcome != "ok" for x in done), per_s, p50, p99)


def _lane_total(lane: Lane, parts: list[LaneStatus], records: list[RecentResult],
                now_ms: int, window_s: float) -> LaneStatus:
    """A lane over every partition: counts and rates summed (each partition's recent list
    is capped on its own, so each rate is taken over its own span), latency percentiles
    over every partition's results in the window."""
    if len(parts) == 1:
        return parts[0]
    since = now_ms - window_s * 1000
    p50, p99 = _latencies([x for x in records if x.lane is lane and x.finished_ms >= since])
    return LaneStatus(lane.value, sum(x.length for x in parts), sum(x.pending for x in parts),
                      sum(x.lag for x in parts), sum(x.results for x in parts),
                      sum(x.errors for x in parts), sum(x.results_per_s for x in parts),
                      p50, p99)


def _latencies(done: list[RecentResult]) -> tuple[float | None, float | None]:
    """p50 and p99 end to end of the ok results among ``done``, as the Prometheus
    histograms count them: an error answered at once (expired, bad input) would pull the
    percentiles down."""
    totals = sorted(x.total_ms for x in done if x.total_ms is not None and x.outcome == "ok")
    return _percentile(totals, 0.50), _percentile(totals, 0.99)


def _decode_recent(raw: Any) -> list[RecentResult]:
    """Newest first, as the list holds them; records this version cannot read are skipped."""
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append(RecentResult.decode(item))
        except ProtocolError:
            continue
    return out


def _window(records: list[RecentResult], now_ms: int,
            window_s: float) -> tuple[list[RecentResult], float]:
    """The records of the last ``window_s`` and their rate per second.

    The list is capped at RECENT_MAX for the whole partition: when it is full and its
    oldest record is inside the window, the rate is taken over the span it covers.
    """
    since = now_ms - window_s * 1000
    done = [x for x in records if x.finished_ms >= since]
    span_s = window_s
    if done and len(records) >= RECENT_MAX and records[-1].finished_ms >= since:
        span_s = max(1.0, (now_ms - records[-1].finished_ms) / 1000)
    return done, len(done) / span_s


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None without values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return round(sorted_values[rank - 1], 1)


def _workers(r: redis.Redis, keys: Keys, members: Any, now_ms: int) -> list[WorkerStatus]:
    if not isinstance(members, list) or not members:
        return []
    consumers = [m.decode(errors="replace") for m, _ in members]
    raw = r.mget([keys.worker(c) for c in consumers])  # one slot: the model's hash tag
    out = []
    for consumer, (_, score), data in zip(consumers, members, raw, strict=True):
        record = _decode_worker(data)
        seen = record.last_seen_ms if record else int(score)
        out.append(WorkerStatus(consumer, data is not None, seen,
                                round(max(0.0, (now_ms - seen) / 1000), 1), record))
    return sorted(out, key=lambda w: (not w.alive, w.consumer))


def _decode_worker(data: Any) -> WorkerRecord | None:
    if not isinstance(data, bytes):
        return None
    try:
        return WorkerRecord.decode(data)
    except ProtocolError:
        return None
