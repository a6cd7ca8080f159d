"""What the bench scripts share: workloads, load drivers, memory sampling, CSV and plots.

Not a benchmark itself. The scripts import it as a sibling module (``python bench/x.py``
puts ``bench/`` on the path).

Load drivers. A *target* is anything that queues jobs whose ids come back on one Redis list
(redbatch's ``reply_to``, or the raw-Redis imitation in ``overhead.py``); a
:class:`Collector` pops that list and reads each finished job's result key.

* :func:`closed_loop` keeps a fixed number of jobs in flight (a new job as each one
  finishes): warm-up (not recorded), steady phase (recorded), drain (no new jobs; waits for
  the in-flight ones). Throughput is completions in the steady phase over its length.
* :func:`open_loop` submits at Poisson arrival times, whatever the answers do, and measures
  each job from its *scheduled* arrival, so a client that falls behind cannot hide queueing
  (no coordinated omission).

All times are ``time.perf_counter`` of this process, so submit and finish share one clock.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import random
import re
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import psutil
import redis
from PIL import Image, ImageDraw
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.common.protocol import JobEnvelope, Keys, Lane, ResultEnvelope
from redbatch.gpu_worker.device import malloc_tuning
from redbatch.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
#: Where CSVs, plots and worker logs go; set_out_dir() moves it for one run.
OUT = ROOT / "bench" / "out"
MIB = 1024 * 1024


def set_out_dir(path: str | Path) -> Path:
    """Write this run's CSVs, plots and worker logs under PATH (made when missing) instead
    of bench/out, so that a run kept apart (bench/gpu_check.sh) has everything in one folder.
    Returns the absolute path."""
    global OUT
    OUT = Path(path).resolve()
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


# ---------------------------------------------------------------------------- environment


def reexec_with_worker_malloc() -> None:
    """Re-run this script under the worker's malloc settings
    (gpu_worker/device/malloc_tuning.py), so in-process baselines and the client run under the
    same glibc as the worker."""
    if malloc_tuning.wanted():
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **malloc_tuning.MALLOC_ENV})


def machine_load() -> str:
    """The 1/5/15-minute load averages against the core count, with a warning when other
    work competes for the cores (then absolute figures mean little; ratios from one run
    still compare like with like, but multi-threaded torch suffers most from it)."""
    one, five, fifteen = os.getloadavg()
    cores = os.cpu_count() or 1
    note = f"load average {one:.1f} {five:.1f} {fifteen:.1f} on {cores} cores"
    return note + ("  WARNING: the machine is busy; re-run on a quiet one"
                   if one > 0.75 * cores else "")


def untuned_env() -> dict[str, str]:
    """This environment without the malloc tuning: for baselines that must run as a user's
    plain script would (glibc defaults)."""
    return {k: v for k, v in os.environ.items()
            if k not in malloc_tuning.MALLOC_ENV and k != malloc_tuning.OPT_OUT}


# ---------------------------------------------------------------------------- workloads


def photos() -> list[bytes]:
    """The sample photos (JPEG, 39-113 kB), in name order."""
    return [p.read_bytes() for p in sorted((ROOT / "samples").glob("*.jpg"))]


def workload(n: int) -> list[bytes]:
    """``n`` payloads cycling through the sample photos."""
    base = photos()
    return [base[i % len(base)] for i in range(n)]


def tiny_jpegs(n: int, size: int = 32, seed: int = 1234) -> list[bytes]:
    """``n`` distinct small JPEGs (a colour, a rectangle, some noise): decoding is ~0.1 ms."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
        x0, y0 = rng.randrange(size // 2), rng.randrange(size // 2)
        ImageDraw.Draw(img).rectangle((x0, y0, x0 + size // 3, y0 + size // 3),
                                      fill=tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def tensors(n: int, seed: int = 1234) -> list[bytes]:
    """``n`` payloads of the ``null_tensor`` model (four little-endian float32 values each):
    nothing to decode, so the worker preprocesses them inline."""
    rng = random.Random(seed)
    return [struct.pack("<4f", *(rng.uniform(-1, 1) for _ in range(4))) for _ in range(n)]


def payloads_for(model: str) -> list[bytes]:
    """What the benches send a model: tensors to ``null_tensor``, tiny JPEGs to ``null``,
    the sample photos to the others."""
    if model == "null_tensor":
        return tensors(300)
    return tiny_jpegs(300) if model == "null" else photos()


# ---------------------------------------------------------------------------- statistics


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def latency_summary(ms: Sequence[float]) -> dict[str, float]:
    """mean, p50, p95, p99 and max of latencies in ms (NaN when empty)."""
    if not len(ms):
        return dict.fromkeys(("mean", "p50", "p95", "p99", "max"), float("nan"))
    return {"mean": float(np.mean(ms)), "p50": pct(ms, 50), "p95": pct(ms, 95),
            "p99": pct(ms, 99), "max": float(np.max(ms))}


def where_time_went(done: Sequence[Completed], slowest: float = 0.01) -> dict[str, float]:
    """Mean ms per stage of the slowest ``slowest`` share of ``done`` (at least one): the
    worker's own timings, the time in the worker that no stage accounts for (waiting for a
    preprocessing process, or for the answer to be written), and the client's side
    (submit, Redis, collecting: client latency minus the worker's total)."""
    worst = sorted(done, key=lambda c: -c.latency_ms)[:max(1, round(len(done) * slowest))]
    if not worst:
        return {}
    stages = ("queue_ms", "preprocess_ms", "batch_wait_ms", "inference_ms")
    out = {k: float(np.mean([c.finished.timings.get(k, np.nan) for c in worst]))
           for k in stages}
    total = float(np.mean([c.finished.worker_total_ms for c in worst]))
    out["unaccounted_in_worker_ms"] = total - sum(out.values())
    out["client_side_ms"] = float(np.mean([c.latency_ms for c in worst])) - total
    out["latency_ms"] = float(np.mean([c.latency_ms for c in worst]))
    return out


def verdict(value: float, target: float, higher_is_better: bool = True) -> str:
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "MISSED"


# ---------------------------------------------------------------------------- memory


def tree_rss(pid: int) -> int:
    """RSS of ``pid`` plus all its descendants (the worker and its pool processes), bytes."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class RssSampler:
    """Samples :func:`tree_rss` of one process every ``every_s`` in a thread; keeps the peak."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak = 0
        self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def watch(self, pid: int) -> None:
        """Sample ``pid`` from now on (for a sampler started before its process)."""
        self.pid = pid

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.pid:
                self.last = tree_rss(self.pid)
                self.peak = max(self.peak, self.last)
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------- workers


@dataclass(slots=True)
class StartedWorker:
    """A ``redbatch worker`` started by a bench script, logging at INFO to ``log``, and what
    its start-up log says it chose (max batch, variant, threads: flags, profile or defaults).
    """

    proc: subprocess.Popen[bytes]
    log: Path
    #: key=value pairs of its "model ready" line (max_batch, variant, torch_threads, ...).
    ready: dict[str, str] = field(default_factory=dict)
    #: Its "tuning:" lines (profile loaded, measured or not used).
    tuning: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def max_batch(self) -> int | None:
        return int(self.ready["max_batch"]) if "max_batch" in self.ready else None

    @property
    def variant(self) -> str:
        return self.ready.get("variant", "eager")

    def describe(self) -> str:
        keys = ("max_batch", "max_wait_ms", "variant", "torch_threads", "pool",
                "preferred_batch_sizes")
        return " ".join(f"{k}={self.ready[k]}" for k in keys if k in self.ready)

    def stop(self) -> int:
        return stop_worker(self.proc)


_READY = re.compile(r"model ready: (.*)$")
_TUNING = re.compile(r"tuning: (.*)$")


def start_worker(url: str, model_name: str, args: Sequence[str], log_name: str,
                 timeout_s: float = 900.0,
                 on_spawn: Callable[[int], None] | None = None,
                 metrics_port: int = 0) -> StartedWorker:
    """Spawn ``redbatch worker --redis URL ARGS`` (log at INFO into bench/out/LOG_NAME, no
    metrics port unless given) and wait until it reads jobs; a first start may calibrate
    for minutes. ``on_spawn(pid)`` is called as soon as the process exists."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / log_name
    with open(path, "wb") as log:
        proc = spawn_worker(url, [*args, "--metrics-port", str(metrics_port),
                                  "--log-level", "INFO"],
                            stdout=log, stderr=subprocess.STDOUT)
    worker = StartedWorker(proc, path)
    if on_spawn is not None:
        on_spawn(proc.pid)
    try:
        # Its own "model ready" line, not the group's consumers: a worker that ran before on
        # the same Redis stays listed there, and this one may still be calibrating.
        deadline = time.monotonic() + timeout_s
        while not _parse_log(worker):
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with code {proc.returncode}; see {path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker not ready after {timeout_s:g} s; see {path}")
            time.sleep(0.2)
        wait_worker_ready(url, Keys(model_name), proc, timeout_s)
    except BaseException:
        worker.stop()
        raise
    return worker


def _parse_log(worker: StartedWorker) -> bool:
    """Read the worker's start-up choices from its log; True once it says the model is ready."""
    worker.tuning = []
    for line in worker.log.read_text(errors="replace").splitlines():
        if m := _READY.search(line):
            worker.ready = dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", m.group(1)))
        elif m := _TUNING.search(line):
            worker.tuning.append(m.group(1))
    return bool(worker.ready)


# ---------------------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class Finished:
    """One job seen finished by the client."""

    rid: str
    seen_at: float
    ok: bool
    batch_size: int
    inference_ms: float
    worker_total_ms: float
    #: The result's stage timings, ms (queue_ms, preprocess_ms, batch_wait_ms, ...).
    timings: Mapping[str, float] = field(default_factory=dict)


class Target(Protocol):
    reply_key: str

    def submit(self, n: int) -> list[str]: ...

    def result_key(self, rid: str) -> str: ...

    def decode(self, rid: str, data: bytes | None, seen_at: float) -> Finished: ...


class RedbatchTarget:
    """Jobs through redbatch's client (admission script), answered on one reply list."""

    def __init__(self, url: str, model: str, payloads: Sequence[bytes | str], *,
                 lane: Lane = Lane.INTERACTIVE, timeout_s: float | None = None) -> None:
        self.client = Client(url, model=model)
        self.keys = Keys(model)
        # A list of its own, so no answer of an earlier phase is ever counted in this one.
        self.reply_key = self.keys.reply(f"bench-{uuid.uuid4().hex[:12]}")
        self.lane = lane
        self.timeout_s = timeout_s
        self._payloads = itertools.cycle(payloads)

    def job(self) -> JobEnvelope:
        return self.client.job(next(self._payloads), lane=self.lane, reply_to=self.reply_key,
                               timeout_s=self.timeout_s)

    def submit(self, n: int) -> list[str]:
        return list(self.client.submit_jobs([self.job() for _ in range(n)]))

    def result_key(self, rid: str) -> str:
        return self.keys.result(rid)

    def decode(self, rid: str, data: bytes | None, seen_at: float) -> Finished:
        if data is None:
            return Finished(rid, seen_at, False, 0, float("nan"), float("nan"))
        r = ResultEnvelope.decode(data)
        return Finished(rid, seen_at, r.ok, r.batch_size,
                        float(r.timings.get("inference_ms", float("nan"))),
                        float(r.timings.get("total_ms", float("nan"))), dict(r.timings))

    def close(self) -> None:
        self.client.close()


class Collector:
    """Pops finished ids from the target's reply list and reads their results (one MGET)."""

    def __init__(self, url: str, target: Target) -> None:
        self.r = redis.Redis.from_url(url)
        self.target = target

    def poll(self, timeout_s: float) -> list[Finished]:
        """Finished jobs, waiting up to ``timeout_s`` for the first; [] on timeout."""
        first = self.r.blpop([self.target.reply_key], timeout=timeout_s)
        if not first:
            return []
        seen_at = time.perf_counter()
        rids = [first[1], *(self.r.lpop(self.target.reply_key, 1000) or [])]
        ids = [x.decode() for x in rids]
        found = self.r.mget([self.target.result_key(rid) for rid in ids])
        return [self.target.decode(rid, data, seen_at)
                for rid, data in zip(ids, found, strict=True)]

    def close(self) -> None:
        self.r.close()


# ---------------------------------------------------------------------------- drivers


@dataclass(slots=True)
class Completed:
    """A finished job with its client-side latency (from submit, or scheduled arrival), ms."""

    finished: Finished
    latency_ms: float


@dataclass(slots=True)
class ClosedRun:
    window: int
    steady_s: float
    steady: list[Completed] = field(default_factory=list)
    drained: int = 0
    drain_s: float = 0.0
    failed: int = 0

    @property
    def throughput(self) -> float:
        return len(self.steady) / self.steady_s if self.steady_s else float("nan")

    def latencies(self) -> list[float]:
        return [c.latency_ms for c in self.steady]


def closed_loop(url: str, target: Target, window: int, steady_s: float,
                warmup_s: float = 0.0, drain_timeout_s: float = 300.0) -> ClosedRun:
    """Keep ``window`` jobs in flight: warm-up, steady phase (recorded), drain.

    A job counts in the steady phase when it finishes inside it. Raises TimeoutError when
    the drain takes longer than ``drain_timeout_s``.
    """
    collector = Collector(url, target)
    inflight: dict[str, float] = {}
    run = ClosedRun(window, steady_s)
    try:
        now = time.perf_counter()
        steady_at, stop_at = now + warmup_s, now + warmup_s + steady_s
        _submit_into(target, window, inflight)
        while time.perf_counter() < stop_at:
            done = collector.poll(0.5)
            for f in done:
                if f.rid not in inflight:
                    continue  # not ours: a leftover on the reply list
                latency = (f.seen_at - inflight.pop(f.rid)) * 1000
                if not f.ok:
                    run.failed += 1
                elif steady_at <= f.seen_at < stop_at:
                    run.steady.append(Completed(f, latency))
            if done and time.perf_counter() < stop_at:
                _submit_into(target, len(done), inflight)
        drain_start = time.perf_counter()
        while inflight:
            if time.perf_counter() - drain_start > drain_timeout_s:
                raise TimeoutError(f"{len(inflight)} jobs still in flight after the drain")
            for f in collector.poll(0.5):
                if inflight.pop(f.rid, None) is not None:
                    run.drained += 1
        run.drain_s = time.perf_counter() - drain_start
    finally:
        collector.close()
    return run


def _submit_into(target: Target, n: int, inflight: dict[str, float]) -> None:
    now = time.perf_counter()
    for rid in target.submit(n):
        inflight[rid] = now


@dataclass(slots=True)
class OpenRun:
    rate: float
    seconds: float
    completed: list[Completed] = field(default_factory=list)
    submitted: int = 0
    failed: int = 0
    #: Seconds from the last arrival to the last answer.
    drain_s: float = 0.0
    #: Largest lag of the submitter behind the schedule, ms (client overload check).
    max_submit_lag_ms: float = 0.0
    #: What ended the submitter thread early, if anything (raised by open_loop).
    submit_error: BaseException | None = None

    @property
    def achieved(self) -> float:
        """Answers per second between the first arrival and the last answer."""
        span = self.seconds + self.drain_s
        return len(self.completed) / span if span else float("nan")

    def latencies(self) -> list[float]:
        return [c.latency_ms for c in self.completed]


def poisson_schedule(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival offsets, seconds, of a Poisson process of ``rate``/s over ``seconds``."""
    out, at = [], rng.expovariate(rate)
    while at < seconds:
        out.append(at)
        at += rng.expovariate(rate)
    return out


def open_loop(url: str, target: Target, rate: float, seconds: float, seed: int,
              drain_timeout_s: float = 300.0) -> OpenRun:
    """Poisson arrivals at ``rate``/s for ``seconds``; latency from each scheduled arrival.

    Arrivals that fall due together (the submitter was late) go in one pipelined call.
    """
    schedule = poisson_schedule(rate, seconds, random.Random(seed))
    run = OpenRun(rate, seconds, submitted=len(schedule))
    scheduled: dict[str, float] = {}
    submitter = threading.Thread(target=_submit_on_schedule,
                                 args=(target, schedule, scheduled, run), daemon=True)
    collector = Collector(url, target)
    seen: list[Finished] = []
    try:
        t0 = time.perf_counter()
        run.seconds = seconds
        submitter.start()
        deadline = t0 + seconds + drain_timeout_s
        while len(seen) < len(schedule) and time.perf_counter() < deadline:
            if run.submit_error is not None:
                raise RuntimeError("the submitter failed") from run.submit_error
            seen.extend(collector.poll(0.5))
        submitter.join()
        run.drain_s = max(0.0, (seen[-1].seen_at if seen else t0) - (t0 + seconds))
    finally:
        collector.close()
    if run.submit_error is not None:
        raise RuntimeError("the submitter failed") from run.submit_error
    if len(seen) < len(schedule):
        raise TimeoutError(f"{len(schedule) - len(seen)} jobs unanswered after the drain")
    for f in seen:
        if f.ok:
            run.completed.append(Completed(f, (f.seen_at - scheduled[f.rid]) * 1000))
        else:
            run.failed += 1
    return run


def _submit_on_schedule(target: Target, schedule: list[float], scheduled: dict[str, float],
                        run: OpenRun) -> None:
    try:
        _submit_all(target, schedule, scheduled, run)
    except BaseException as e:  # handed to open_loop, which raises it with its cause
        run.submit_error = e


def _submit_all(target: Target, schedule: list[float], scheduled: dict[str, float],
                run: OpenRun) -> None:
    t0 = time.perf_counter()
    i = 0
    while i < len(schedule):
        delay = t0 + schedule[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        now = time.perf_counter() - t0
        j = i
        while j < len(schedule) and schedule[j] <= now:
            j += 1
        run.max_submit_lag_ms = max(run.max_submit_lag_ms, (now - schedule[i]) * 1000)
        for rid, at in zip(target.submit(j - i), schedule[i:j], strict=True):
            scheduled[rid] = t0 + at
        i = j


# ---------------------------------------------------------------------------- Redis's own counts


@dataclass(frozen=True, slots=True)
class CommandStat:
    """One command's line of ``INFO commandstats``: calls so far, and microseconds spent
    executing them (not reading or parsing them, not writing the reply)."""

    calls: int
    usec: float


def command_stats(r: redis.Redis) -> dict[str, CommandStat]:
    """Every command Redis has run since it started, by name (``set``, ``evalsha``,
    ``client|setinfo``), from ``INFO commandstats``. Commands a Lua script calls count too
    (Redis 7), each under its own name, beside the ``evalsha`` that ran the script."""
    info = r.info("commandstats")
    return {name.removeprefix("cmdstat_"): CommandStat(int(v["calls"]), float(v["usec"]))
            for name, v in info.items()}


def commands_between(before: Mapping[str, CommandStat],
                     after: Mapping[str, CommandStat]) -> dict[str, CommandStat]:
    """What Redis ran between two :func:`command_stats`, most calls first (the INFO that
    took ``before`` is among them)."""
    diff = {name: CommandStat(s.calls - before.get(name, CommandStat(0, 0.0)).calls,
                              s.usec - before.get(name, CommandStat(0, 0.0)).usec)
            for name, s in after.items()}
    return dict(sorted(((k, v) for k, v in diff.items() if v.calls > 0),
                       key=lambda kv: kv[1].calls, reverse=True))


# ---------------------------------------------------------------------------- output


def write_csv(name: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def plot(name: str, draw: Callable[[Any], None]) -> Path:
    """Save the figure that ``draw(plt)`` makes (it calls ``plt.subplots``) to
    bench/out/NAME (PNG).

    matplotlib comes with the ``bench`` extra: ``pip install -e '.[bench]'``.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("matplotlib is missing: .venv/bin/pip install -e '.[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    draw(plt)
    path = OUT / name
    plt.savefig(path, dpi=100, bbox_inches="tight")
    plt.close("all")
    return path


def plot_rates(name: str, rates: dict[str, float], title: str, unit: str,
               label_fmt: str = "%.1f", height: float = 4.5) -> Path:
    """A horizontal bar per system, redbatch's in blue, saved as bench/out/NAME."""
    def figure(plt: Any) -> None:
        fig, ax = plt.subplots(figsize=(9, height))
        names = list(rates)
        bars = ax.barh(names, [rates[n] for n in names],
                       color=["tab:blue" if n.startswith("redbatch") else "tab:gray"
                              for n in names])
        ax.bar_label(bars, fmt=label_fmt)
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} (higher is better)")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)

    return plot(name, figure)


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}"
