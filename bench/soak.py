"""Soak: steady load for N minutes while workers are SIGKILLed; memory over time, then the audit.

    .venv/bin/python bench/soak.py [--minutes 30] [--load 0.5 | --rate R] [--workers 2]
        [--kill-every-s 180] [--sample-s 30] [--model efficientnet_lite0] [--csv PATH]

1. starts a private redis-server (AOF on) and --workers `redbatch worker` processes; a
   supervisor restarts any worker that dies, as a container restart policy would;
2. unless --rate is given, measures capacity: a short saturated burst (--capacity-s), jobs/s;
3. for --minutes, open-loop Poisson arrivals of the photos in samples/ at --load x capacity
   (each job with a --timeout-s deadline, answered on one reply list), SIGKILLing a random
   worker every --kill-every-s seconds;
4. every --sample-s seconds: Redis used_memory, DBSIZE, keys by family (result, done, reply,
   stream, other), each lane's XLEN and pending count, each worker's RSS (with its pool and
   other children), and submitted/completed/failed/outstanding. Results of the jobs that
   completed since the last sample are checked with the shared audit while they are kept;
5. stops submitting, waits (at most --drain-s) for every outcome, then runs the audit
   (tests/audit.py: every id has its result and it is ok, nothing pending, every key but
   the streams expires) over every id whose result is still kept.

Prints a row per sample as it goes, then the table again, the least-squares slope per hour of
used_memory, key count and worker RSS (after --warmup-samples, and again past the result TTL
when the run is that long: results live that long, so memory grows until then), latency
percentiles, and last "invariant: OK" or the problems (exit code 1). Writes every sample to
--csv. Every process it started and their /dev/shm segments are gone on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import numpy as np
import psutil
import redis

# The invariant check of the fault tests (tests/audit.py) audits the soak's ids too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from audit import audit, key_kind, outcome, read_results, result_problem
from redbatch.cli.local_stack import count_consumers, spawn_worker, stop_worker
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import model_name_from_spec
from redbatch.common.protocol import GROUP, Keys, Lane, ProtocolError, ResultEnvelope
from redbatch.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MIB = 1024 * 1024
REPLY = "soak"
#: Worker default (--result-ttl-s); memory can only level off once results start expiring.
DEFAULT_RESULT_TTL_S = 600
#: Audit at the end only results younger than this margin under their TTL.
TTL_MARGIN_S = 60.0
TICK_S = 0.25


def photos() -> list[bytes]:
    return [p.read_bytes() for p in sorted((ROOT / "samples").glob("*.jpg"))]


# ---------------------------------------------------------------------------- bookkeeping


class Tracker:
    """Every id submitted, when, and when its answer came back; shared by the threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[str, tuple[float, str]] = {}  # id -> (monotonic time, phase)
        self.done: dict[str, float] = {}
        self.unchecked: list[str] = []
        self.duplicates = 0
        self.submit_errors: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.problems: list[str] = []
        self.checked_early = 0

    def sending(self, rid: str, phase: str) -> None:
        with self.lock:
            self.sent[rid] = (time.monotonic(), phase)

    def not_sent(self, rid: str, error: BaseException) -> None:
        with self.lock:
            self.sent.pop(rid, None)
            self.submit_errors[type(error).__name__] += 1

    def answered(self, rids: list[str]) -> None:
        now = time.monotonic()
        with self.lock:
            for rid in rids:
                if rid in self.done:
                    self.duplicates += 1  # run twice: allowed, one result kept (SET NX)
                elif rid in self.sent:
                    self.done[rid] = now
                    self.unchecked.append(rid)

    def outstanding(self) -> int:
        with self.lock:
            return len(self.sent) - len(self.done)

    def take_unchecked(self) -> list[str]:
        with self.lock:
            rids, self.unchecked = self.unchecked, []
            return rids

    def latencies_ms(self, phase: str) -> list[float]:
        with self.lock:
            return [(self.done[rid] - t) * 1000 for rid, (t, p) in self.sent.items()
                    if p == phase and rid in self.done]


def check_answered(r: redis.Redis, keys: Keys, tracker: Tracker) -> None:
    """Audit the results that came back since the last call, while Redis still keeps them,
    and count the outcomes."""
    rids = tracker.take_unchecked()
    problems, failed = [], Counter[str]()
    for rid, raw in read_results(r, keys, rids).items():
        if (problem := result_problem(rid, raw, None)) is not None:
            problems.append(problem)
        try:
            got = outcome(ResultEnvelope.decode(raw)) if raw is not None else "missing"
        except ProtocolError:
            got = "undecodable"
        if got != "ok":
            failed[got] += 1
    with tracker.lock:
        tracker.problems += problems
        tracker.failed += failed
        tracker.checked_early += len(rids)


class ReplyReader(threading.Thread):
    """Pops answered ids off the soak's reply list (workers push each id there)."""

    def __init__(self, url: str, reply_key: str, tracker: Tracker) -> None:
        super().__init__(name="soak-replies", daemon=True)
        self.r = redis.Redis.from_url(url)
        self.reply_key = reply_key
        self.tracker = tracker
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                first = self.r.blpop([self.reply_key], timeout=0.5)
                if first:
                    more = self.r.lpop(self.reply_key, 1000) or []
                    self.tracker.answered([x.decode() for x in [first[1], *more]])
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.2)


class Producer(threading.Thread):
    """Open-loop Poisson arrivals at ``rate``/s, or (rate None) a backlog kept at ``backlog``."""

    def __init__(self, url: str, model: str, tracker: Tracker, phase: str, timeout_s: float,
                 rate: float | None = None, backlog: int = 0, seed: int = 0) -> None:
        super().__init__(name=f"soak-{phase}", daemon=True)
        self.client = Client(url, model=model)
        self.reply_key = self.client.keys().reply(REPLY)
        self.tracker, self.phase, self.timeout_s = tracker, phase, timeout_s
        self.rate, self.backlog = rate, backlog
        self.rng = random.Random(seed)
        self.payloads = photos()
        self.stop = threading.Event()

    def submit(self, n: int) -> None:
        jobs = [self.client.job(self.rng.choice(self.payloads), timeout_s=self.timeout_s,
                                reply_to=self.reply_key) for _ in range(n)]
        for job in jobs:
            self.tracker.sending(job.request_id, self.phase)
        try:
            self.client.submit_jobs(jobs)
        except (redis.RedisError, OSError) as e:
            for job in jobs:
                self.tracker.not_sent(job.request_id, e)

    def run(self) -> None:
        try:
            if self.rate is None:
                while not self.stop.wait(0.05):
                    self.submit(max(0, self.backlog - self.tracker.outstanding()))
                return
            t0, at = time.monotonic(), 0.0
            while True:
                at += self.rng.expovariate(self.rate)
                # Open loop: a late arrival is sent at once, never skipped.
                if self.stop.wait(max(0.0, t0 + at - time.monotonic())):
                    return
                self.submit(1)
        finally:
            self.client.close()


# ---------------------------------------------------------------------------- workers


def own_shm(pid: int) -> set[str]:
    """/dev/shm entries the process maps (its slot arrays and semaphores)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


@dataclass
class Slot:
    """One supervised worker place: the current process and how often it was started."""

    index: int
    proc: subprocess.Popen[bytes]
    generation: int = 0


@dataclass
class Fleet:
    """K workers under a restart policy; remembers every process and /dev/shm entry they had,
    so that all of them can be cleaned up."""

    url: str
    worker_args: list[str]
    size: int
    slots: list[Slot] = field(default_factory=list)
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    shm: set[str] = field(default_factory=set)
    kills: int = 0
    restarts: int = 0
    unexpected_exits: list[str] = field(default_factory=list)
    #: Exits we did not cause after which the run gives up (a crash loop, e.g. a bad model).
    max_unexpected: int = 10

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        with open(OUT / f"soak-worker-{index}.log", "ab") as log:
            proc = spawn_worker(self.url, self.worker_args, env={"REDBATCH_METRICS_PORT": "0"},
                                stdout=log, stderr=subprocess.STDOUT)
        self._remember(proc.pid)
        return proc

    def start(self) -> None:
        for i in range(self.size):  # one log per place, across its restarts, for this run
            (OUT / f"soak-worker-{i}.log").write_bytes(b"")
        self.slots = [Slot(i, self._spawn(i)) for i in range(self.size)]

    def _remember(self, pid: int) -> list[psutil.Process]:
        """The process and its descendants, recorded with their shared memory."""
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            return []
        for p in family:
            self.seen.setdefault(p.pid, p)
            self.shm |= own_shm(p.pid)
        return family

    def supervise(self, killed: set[int]) -> None:
        """Restart every worker that exited; one not killed by us is reported."""
        for slot in self.slots:
            code = slot.proc.poll()
            if code is None:
                continue
            if slot.proc.pid not in killed:
                self.unexpected_exits.append(f"worker {slot.index} pid {slot.proc.pid} exited "
                                             f"with code {code}")
                if len(self.unexpected_exits) > self.max_unexpected:
                    raise RuntimeError(f"workers keep dying: {self.unexpected_exits[-3:]}; "
                                       "see bench/out/soak-worker-*.log")
            slot.proc = self._spawn(slot.index)
            slot.generation += 1
            self.restarts += 1

    def kill_one(self, rng: random.Random) -> int | None:
        alive = [s for s in self.slots if s.proc.poll() is None]
        if not alive:
            return None
        victim = rng.choice(alive).proc
        self._remember(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)
        self.kills += 1
        return victim.pid

    def rss(self) -> list[int]:
        """Each slot's RSS: the worker plus its pool and other children (0 while down)."""
        out = []
        for slot in self.slots:
            total = 0
            for p in self._remember(slot.proc.pid) if slot.proc.poll() is None else []:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            out.append(total)
        return out

    def close(self) -> list[str]:
        """Stop the workers, then any process or /dev/shm entry of theirs left; what was left."""
        for slot in self.slots:
            self._remember(slot.proc.pid)
            stop_worker(slot.proc, timeout_s=20)
        left = []
        # A SIGKILLed worker's children notice, exit, and its tracker unlinks its segments.
        _, alive = psutil.wait_procs([p for p in self.seen.values() if _running(p)], timeout=20)
        for p in alive:
            left.append(f"process {p.pid} killed")
            p.kill()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _existing(self.shm):
            time.sleep(0.2)
        for name in _existing(self.shm):
            left.append(f"/dev/shm/{name} unlinked")
            Path("/dev/shm", name).unlink(missing_ok=True)
        return left


def _running(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _existing(names: set[str]) -> list[str]:
    return sorted(n for n in names if Path("/dev/shm", n).exists())


# ---------------------------------------------------------------------------- samples


@dataclass(slots=True)
class Sample:
    t_s: float
    phase: str
    submitted: int
    completed: int
    failed: int
    outstanding: int
    used_memory: int
    used_memory_rss: int
    dbsize: int
    keys_result: int
    keys_done: int
    keys_owner: int
    keys_reply: int
    keys_stream: int
    keys_other: int
    xlen_interactive: int
    pending_interactive: int
    xlen_bulk: int
    pending_bulk: int
    kills: int
    restarts: int
    worker_rss: list[int]
    worker_gen: list[int]

    def row(self) -> list[object]:
        flat = [getattr(self, f) for f in self.__slots__ if f not in ("worker_rss", "worker_gen")]
        return [*flat, sum(self.worker_rss),
                *(x for pair in zip(self.worker_rss, self.worker_gen, strict=True) for x in pair)]

    def header(self) -> list[str]:
        names = [f for f in self.__slots__ if f not in ("worker_rss", "worker_gen")]
        return [*names, "worker_rss_total",
                *(x for i in range(len(self.worker_rss)) for x in (f"w{i}_rss", f"w{i}_gen"))]


def lane_state(r: redis.Redis, keys: Keys, lane: Lane) -> tuple[int, int]:
    stream = keys.stream(lane)
    try:
        return int(r.xlen(stream)), int(r.xpending(stream, GROUP)["pending"])
    except redis.ResponseError:
        return int(r.xlen(stream)), 0


def key_counts(r: redis.Redis, keys: Keys) -> Counter[str]:
    return Counter(key_kind(keys, k.decode()) for k in r.scan_iter(count=1000))


def take_sample(t0: float, phase: str, r: redis.Redis, keys: Keys, tracker: Tracker,
                fleet: Fleet) -> Sample:
    check_answered(r, keys, tracker)
    info = r.info("memory")
    kinds = key_counts(r, keys)
    with tracker.lock:
        sent, done, failed = len(tracker.sent), len(tracker.done), sum(tracker.failed.values())
    xlen_i, pending_i = lane_state(r, keys, Lane.INTERACTIVE)
    xlen_b, pending_b = lane_state(r, keys, Lane.BULK)
    return Sample(
        t_s=round(time.monotonic() - t0, 1), phase=phase, submitted=sent, completed=done,
        failed=failed, outstanding=sent - done, used_memory=int(info["used_memory"]),
        used_memory_rss=int(info["used_memory_rss"]), dbsize=int(r.dbsize()),
        keys_result=kinds["result"], keys_done=kinds["done"], keys_owner=kinds["owner"],
        keys_reply=kinds["reply"], keys_stream=kinds["stream"], keys_other=kinds["other"],
        xlen_interactive=xlen_i, pending_interactive=pending_i, xlen_bulk=xlen_b,
        pending_bulk=pending_b, kills=fleet.kills, restarts=fleet.restarts,
        worker_rss=fleet.rss(), worker_gen=[s.generation for s in fleet.slots])


#: The printed table: title, width, value. Keys by family, queued (XLEN) and pending are
#: summed over the lanes; the CSV has each.
COLUMNS: list[tuple[str, int, Callable[[Sample], object]]] = [
    ("t_s", 6, lambda s: f"{s.t_s:.0f}"), ("phase", 7, lambda s: s.phase),
    ("sent", 7, lambda s: s.submitted), ("done", 7, lambda s: s.completed),
    ("fail", 4, lambda s: s.failed), ("out", 5, lambda s: s.outstanding),
    ("used MiB", 8, lambda s: f"{s.used_memory / MIB:.2f}"), ("keys", 6, lambda s: s.dbsize),
    ("result", 6, lambda s: s.keys_result), ("done", 6, lambda s: s.keys_done),
    ("owner", 6, lambda s: s.keys_owner), ("reply", 5, lambda s: s.keys_reply),
    ("strm", 4, lambda s: s.keys_stream), ("other", 5, lambda s: s.keys_other),
    ("xlen", 4, lambda s: s.xlen_interactive + s.xlen_bulk),
    ("pend", 4, lambda s: s.pending_interactive + s.pending_bulk),
    ("kills", 5, lambda s: s.kills),
]


def print_header(workers: int) -> None:
    titles = [f"{t:>{w}}" for t, w, _ in COLUMNS] + [f"{f'w{i} MiB':>7}" for i in range(workers)]
    print(" ".join(titles), flush=True)


def print_sample(s: Sample) -> None:
    cells = [f"{str(v(s)):>{w}}" for _, w, v in COLUMNS]
    print(" ".join(cells + [f"{x / MIB:7.1f}" for x in s.worker_rss]), flush=True)


# ---------------------------------------------------------------------------- the run


@dataclass
class Run:
    """One soak: owns the Redis server, the fleet and the load threads; ``close`` stops all."""

    args: argparse.Namespace
    keys: Keys
    server: RedisServer = field(default_factory=lambda: RedisServer(appendonly=True))
    tracker: Tracker = field(default_factory=Tracker)
    samples: list[Sample] = field(default_factory=list)
    threads: list[Producer | ReplyReader] = field(default_factory=list)
    fleet: Fleet | None = None
    killed: set[int] = field(default_factory=set)
    capacity: float | None = None
    rate: float = 0.0
    problems: list[str] = field(default_factory=list)
    audited_at_end: int | None = None
    _r: redis.Redis | None = None

    @property
    def r(self) -> redis.Redis:
        if self._r is None:
            self._r = redis.Redis.from_url(self.server.url)
        return self._r

    def _start(self, thread: Producer | ReplyReader) -> None:
        self.threads.append(thread)
        thread.start()

    def _halt(self, thread: Producer | ReplyReader) -> None:
        thread.stop.set()
        thread.join(timeout=10)

    def _wait(self, seconds: float, until: float | None = None) -> None:
        """Sleep ``seconds`` while keeping the fleet supervised; stop early when the
        outstanding count reaches ``until``."""
        assert self.fleet is not None
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.fleet.supervise(self.killed)
            if until is not None and self.tracker.outstanding() <= until:
                return
            time.sleep(TICK_S)

    def start(self) -> None:
        a = self.args
        self.server.start()
        worker_args = ["--model", a.model, "--log-level", "WARNING",
                       "--result-ttl-s", str(a.result_ttl_s), *shlex.split(a.worker_args)]
        self.fleet = Fleet(self.server.url, worker_args, a.workers)
        self.fleet.start()
        r, deadline = self.r, time.monotonic() + 300
        while count_consumers(r, self.keys) < a.workers:
            if time.monotonic() > deadline:
                raise TimeoutError("workers not ready after 300 s; see bench/out/soak-worker-*")
            self._wait(0.5)
        self._start(ReplyReader(self.server.url, self.keys.reply(REPLY), self.tracker))
        print(f"redis {self.server.url} (AOF on), {a.workers} workers of {a.model} ready",
              flush=True)

    def measure_capacity(self) -> float:
        """Jobs/s over the last three quarters of a burst that keeps every worker busy."""
        a = self.args
        producer = Producer(self.server.url, self.keys.model, self.tracker, "capacity",
                            a.timeout_s, backlog=a.workers * 128)
        self._start(producer)
        self._wait(a.capacity_s / 4)
        before, t = len(self.tracker.done), time.monotonic()
        self._wait(a.capacity_s * 3 / 4)
        jobs_s = (len(self.tracker.done) - before) / (time.monotonic() - t)
        self._halt(producer)
        self._wait(a.drain_s, until=0)
        return jobs_s

    def soak(self) -> None:
        a = self.args
        assert self.fleet is not None
        rng = random.Random(a.seed)
        r = self.r
        producer = Producer(self.server.url, self.keys.model, self.tracker, "soak",
                            a.timeout_s, rate=self.rate, seed=a.seed)
        t0 = time.monotonic()
        next_kill = t0 + a.kill_every_s if a.kill_every_s > 0 else float("inf")
        next_sample, end = t0, t0 + a.minutes * 60
        print_header(a.workers)
        self._start(producer)
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_kill:
                pid = self.fleet.kill_one(rng)
                if pid is not None:
                    self.killed.add(pid)
                    print(f"{now - t0:6.0f}  SIGKILL worker pid {pid}", flush=True)
                next_kill += a.kill_every_s
            if now >= next_sample:
                self.samples.append(take_sample(t0, "soak", r, self.keys, self.tracker,
                                                self.fleet))
                print_sample(self.samples[-1])
                next_sample += a.sample_s
            self._wait(min(TICK_S, max(0.0, min(next_kill, next_sample, end) - now)))
        self.samples.append(take_sample(t0, "soak", r, self.keys, self.tracker, self.fleet))
        print_sample(self.samples[-1])
        self._halt(producer)
        print(f"stopped submitting; waiting up to {a.drain_s:.0f} s for "
              f"{self.tracker.outstanding()} outstanding jobs", flush=True)
        self._wait(a.drain_s, until=0)
        self._wait(2)  # late duplicates of jobs run twice
        self.samples.append(take_sample(t0, "drained", r, self.keys, self.tracker, self.fleet))
        print_sample(self.samples[-1])

    def final_audit(self) -> None:
        """The shared audit over every id whose result is still kept (older ones were audited
        as they came back), plus every id never answered."""
        keep_s = self.args.result_ttl_s - TTL_MARGIN_S
        now = time.monotonic()
        with self.tracker.lock:
            ids = [rid for rid in self.tracker.sent
                   if rid not in self.tracker.done or now - self.tracker.done[rid] < keep_s]
        self.audited_at_end = len(ids)
        check_answered(self.r, self.keys, self.tracker)
        found = self.tracker.problems + audit(self.r, self.keys, dict.fromkeys(ids))
        self.problems = list(dict.fromkeys(found))  # recent ids were also checked early

    def close(self) -> list[str]:
        for thread in self.threads:
            self._halt(thread)
        left = self.fleet.close() if self.fleet is not None else []
        if self._r is not None:
            self._r.close()
        self.server.stop()
        return left


# ---------------------------------------------------------------------------- report


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    t = np.array([p[0] for p in points]) / 3600
    return float(np.polyfit(t, np.array([p[1] for p in points]), 1)[0])


def fmt_slope(value: float | None, unit: str, scale: float = 1.0) -> str:
    return "n/a (fewer than 3 samples)" if value is None else f"{value / scale:+.2f} {unit}/h"


def rss_points(samples: list[Sample], worker: int) -> list[list[tuple[float, float]]]:
    """One series per generation of a worker place, without its first sample (start-up)."""
    series: dict[int, list[tuple[float, float]]] = {}
    for s in samples:
        if s.worker_rss[worker]:
            series.setdefault(s.worker_gen[worker], []).append((s.t_s, s.worker_rss[worker]))
    return [points[1:] for points in series.values()]


def print_slopes(samples: list[Sample], label: str) -> None:
    if not samples:
        return
    print(f"slopes {label} ({len(samples)} samples, t {samples[0].t_s:.0f}-"
          f"{samples[-1].t_s:.0f} s):")
    for name, attr, scale, unit in (("used_memory", "used_memory", MIB, "MiB"),
                                    ("used_memory_rss", "used_memory_rss", MIB, "MiB"),
                                    ("DBSIZE", "dbsize", 1, "keys")):
        value = slope_per_hour([(s.t_s, getattr(s, attr)) for s in samples])
        print(f"  {name:24} {fmt_slope(value, unit, scale)}")
    for w in range(len(samples[0].worker_rss)):
        for g, points in enumerate(rss_points(samples, w)):
            value = slope_per_hour(points)
            if value is not None:
                print(f"  worker {w} RSS (start {g + 1}) {fmt_slope(value, 'MiB', MIB)} over "
                      f"{len(points)} samples")


def report(run: Run, left: list[str]) -> None:
    a, t = run.args, run.tracker
    soak = [s for s in run.samples if s.phase == "soak"]
    print()
    print(f"cores={os.cpu_count()} model={a.model} workers={a.workers} minutes={a.minutes} "
          f"kill_every_s={a.kill_every_s} sample_s={a.sample_s} result_ttl_s={a.result_ttl_s}")
    cap = f"{run.capacity:.1f} jobs/s measured" if run.capacity else "not measured (--rate)"
    print(f"capacity {cap}; soak rate {run.rate:.2f} jobs/s")
    print_header(a.workers)
    for s in run.samples:
        print_sample(s)
    print_slopes(soak[a.warmup_samples:], f"after {a.warmup_samples} warm-up samples")
    steady = [s for s in soak if s.t_s >= a.result_ttl_s]
    if len(steady) >= 3:
        print_slopes(steady, f"past the result TTL ({a.result_ttl_s} s), steady state")
    else:
        print(f"(run shorter than the result TTL of {a.result_ttl_s} s plus 3 samples: "
              "result keys still accumulate, so memory and key slopes include that ramp)")
    lat = t.latencies_ms("soak")
    if lat:
        p50, p99, p999 = np.percentile(lat, [50, 99, 99.9])
        print(f"latency soak n={len(lat)}  p50 {p50:.1f} ms  p99 {p99:.1f} ms  p99.9 "
              f"{p999:.1f} ms  max {max(lat):.1f} ms  over 5 s: {sum(x > 5000 for x in lat)}")
    fleet = run.fleet
    if fleet is not None:
        print(f"kills {fleet.kills}, restarts {fleet.restarts}, unexpected exits "
              f"{fleet.unexpected_exits or 'none'}")
    print(f"submitted {len(t.sent)}, answered {len(t.done)}, answered twice {t.duplicates}, "
          f"failed {dict(t.failed) or 0}, submit errors {dict(t.submit_errors) or 0}")
    for line in left:
        print(f"cleanup: {line}")
    if run.audited_at_end is None:
        print("invariant: not checked (the run did not finish)")
        return
    print(f"audited: {t.checked_early} results as they came back, {run.audited_at_end} ids at "
          f"the end (with pending entries and key TTLs)")
    if run.problems:
        print(f"invariant: {len(run.problems)} problems")
        for p in run.problems[:30]:
            print(f"  {p}")
    else:
        print("invariant: OK")


def write_csv(path: Path, samples: list[Sample]) -> None:
    if not samples:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(samples[0].header())
        w.writerows(s.row() for s in samples)
    print(f"samples: {path} ({len(samples)} rows)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.5, help="fraction of measured capacity")
    p.add_argument("--rate", type=float, default=None, help="jobs/s; skips measuring capacity")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kill-every-s", type=float, default=180.0, help="0: never kill")
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--warmup-samples", type=int, default=2, help="left out of the slopes")
    p.add_argument("--capacity-s", type=float, default=20.0, help="length of the burst")
    p.add_argument("--timeout-s", type=float, default=300.0, help="each job's deadline")
    p.add_argument("--drain-s", type=float, default=300.0,
                   help="longest wait for the outstanding jobs at the end")
    p.add_argument("--model", default="efficientnet_lite0", help="e.g. null: nearly free")
    p.add_argument("--result-ttl-s", type=int, default=DEFAULT_RESULT_TTL_S)
    p.add_argument("--worker-args", default="", help="more `redbatch worker` options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=OUT / "soak.csv")
    return p.parse_args()


def main() -> None:
    args = parse_args()

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # so SIGTERM cleans up as Ctrl-C does

    # SIGINT too: a shell starting us in the background would have it ignored.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    OUT.mkdir(parents=True, exist_ok=True)
    run = Run(args, Keys(model_name_from_spec(args.model)))
    code = 0
    try:
        run.start()
        run.capacity = None if args.rate else run.measure_capacity()
        run.rate = args.rate or args.load * (run.capacity or 0.0)
        print(f"capacity {run.capacity or 0:.1f} jobs/s; soaking at {run.rate:.2f} jobs/s for "
              f"{args.minutes:g} min", flush=True)
        run.soak()
        run.final_audit()
        code = 1 if run.problems else 0
    except KeyboardInterrupt:
        print("interrupted; stopping workers and Redis", file=sys.stderr, flush=True)
        code = 130
    finally:
        # A second Ctrl-C must not leave workers or shared memory behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left = run.close()
    report(run, left)
    write_csv(args.csv, run.samples)
    sys.exit(code)


if __name__ == "__main__":
    main()
