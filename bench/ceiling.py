"""How fast one worker and one Redis could ever go: Redis calls and GIL time per job, and the
ceilings they set, beside the model's own rate.

    .venv/bin/python bench/ceiling.py [--seconds 10] [--producers 4] [--window 1024]
                                      [--gil-s 5] [--profile PATH] [--worker-args "..."]

One private redis-server, one ``redbatch worker --model null --calibrate off`` with a large
max batch (256) and in-flight window (--window), and --producers processes, each a closed loop
of the real ``Client``: it keeps --window / --producers jobs in flight, submits in pipelined
groups (``submit_jobs``, --group jobs a call) with ``reply_to`` naming its own reply list,
pops the finished ids from that list and reads their results (one MGET per group), and
submits as many again. The null model decodes a 32x32 JPEG and takes its mean colour, so what
is measured is redbatch. After a warm-up, over a steady phase of --seconds:

* **jobs/s**: jobs answered (counted by the producers) over the phase's length;
* **Redis calls per job**: ``INFO commandstats`` at both ends of the phase (the calls of every
  command, those a Lua script makes included), the difference over the jobs answered; the
  top commands per job too;
* **CPU per job**: user + system time of each thread of the worker's main process (psutil;
  named from ``py-spy dump`` when py-spy is installed), of its pool processes, of
  redis-server and of the producers, over the jobs answered;
* **GIL time per job**: ``py-spy record --gil --threads`` on the worker's pid for --gil-s
  seconds in the phase, at 100 samples/s. With ``--gil`` py-spy keeps a sample only when a
  thread holds the GIL, so samples / (100 x seconds) is the share of wall time the GIL was
  held; that share / jobs/s is GIL-seconds per job (per thread from the same samples).

Projections:

* **one worker**: 1 / GIL-seconds per job. The worker's Python runs under one GIL, so
  however many cores and however fast the device, one worker answers no more jobs/s than
  this (the device's own work releases the GIL). Without py-spy, 1 / the worker process's
  CPU-seconds per job stands in (lower: it counts native work outside the GIL too).
* **one Redis**: the lower of (a) 1 / redis-server's CPU-seconds per job (measured on this
  workload; Redis executes commands on one thread) and (b) the commands/s one Redis core
  does, measured with ``redis-benchmark`` on the same server after the phase (SET, GET,
  LPUSH, RPUSH, HSET, 16 a pipeline, 16 connections; the rate over all of them), divided by
  the calls per job. (b) is optimistic: a script or a blocking pop costs more than a SET.
  Without redis-benchmark, (b) uses the mean ``usec_per_call`` of this workload's commands
  (execution only, no I/O: more optimistic still); the output says which.
* **the model alone**: the best images/s of the chosen variant in a calibration profile
  (--profile, a file ``redbatch calibrate`` wrote); without one this is skipped with a note.

Prints the ratios last: the model's rate against each ceiling, and "the device is the
limit" when the model alone is slower than both ceilings, else which part is.
Writes bench/out/ceiling.csv and bench/out/ceiling.png (--out-dir: elsewhere). A machine
shared with other work changes jobs/s; per-job CPU, calls and GIL time move less, but a
thread descheduled while holding the GIL (more threads than cores) counts as holding it.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import re
import shlex
import shutil
import subprocess
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path

import psutil
import redis
from cpu_budget import cpu_of, py_spy, thread_names
from harness import (
    OUT,
    Collector,
    CommandStat,
    RedbatchTarget,
    StartedWorker,
    command_stats,
    commands_between,
    fmt,
    machine_load,
    plot_rates,
    reexec_with_worker_malloc,
    set_out_dir,
    start_worker,
    tiny_jpegs,
    write_csv,
)
from producers import Producers, shares
from redbatch.cli.redis_server import RedisServer
from redbatch.gpu_worker.tuning.profile import load_profile

MODEL = "null"
MAX_BATCH = 256
#: py-spy samples per second for the GIL share.
GIL_RATE = 100
#: redis-benchmark: tests, pipeline depth, connections, requests per test.
BENCH_TESTS = "set,get,lpush,rpush,hset"
BENCH_PIPELINE = 16
BENCH_CLIENTS = 16
BENCH_REQUESTS = 200_000
#: Longest a producer waits for its last answers after the phase, s.
DRAIN_S = 60.0

# ---------------------------------------------------------------------------- producers


def produce(url: str, index: int, window: int, group: int,
            counts: ctypes.Array[ctypes.c_longlong], stop: Event) -> None:
    """A producer process: keep ``window`` jobs in flight until ``stop``, then wait for
    them. ``counts[2 * index]`` counts the jobs answered, ``counts[2 * index + 1]`` the
    failed ones (only this process writes them)."""
    target = RedbatchTarget(url, MODEL, tiny_jpegs(200, seed=1000 + index))
    collector = Collector(url, target)
    inflight: set[str] = set()
    try:
        submit(target, window, group, inflight)
        while not stop.is_set():
            done = collect(collector, inflight, counts, index)
            if done and not stop.is_set():
                submit(target, done, group, inflight)
        deadline = time.monotonic() + DRAIN_S
        while inflight and time.monotonic() < deadline:
            collect(collector, inflight, counts, index)
    finally:
        collector.close()
        target.close()


def submit(target: RedbatchTarget, n: int, group: int, inflight: set[str]) -> None:
    """``n`` jobs, ``group`` per pipelined call."""
    for start in range(0, n, group):
        inflight.update(target.submit(min(group, n - start)))


def collect(collector: Collector, inflight: set[str], counts: ctypes.Array[ctypes.c_longlong],
            index: int) -> int:
    """The jobs answered since the last call (waiting up to 0.5 s for the first); counted."""
    done = [f for f in collector.poll(0.5) if f.rid in inflight]
    for f in done:
        inflight.discard(f.rid)
    failed = sum(not f.ok for f in done)
    counts[2 * index] += len(done) - failed
    counts[2 * index + 1] += failed
    return len(done)


# ---------------------------------------------------------------------------- measuring


@dataclass(slots=True)
class Snapshot:
    """Counters at one moment: wall clock, jobs answered, Redis's commands, CPU seconds."""

    at: float
    jobs: int
    failed: int
    stats: dict[str, CommandStat]
    #: CPU seconds by part: "redis-server", "producers", "pool", "thread:<tid>".
    cpu: dict[str, float] = field(default_factory=dict)


def snapshot(r: redis.Redis, producers: Producers, worker: psutil.Process,
             server: psutil.Process) -> Snapshot:
    jobs, failed = producers.answered()
    snap = Snapshot(time.perf_counter(), jobs, failed, command_stats(r))
    snap.cpu["redis-server"] = cpu_of(server)
    snap.cpu["producers"] = sum(cpu_of(p) for p in producers.psutil_procs())
    try:
        snap.cpu["pool"] = sum(cpu_of(p) for p in worker.children(recursive=True))
        for t in worker.threads():
            snap.cpu[f"thread:{t.id}"] = t.user_time + t.system_time
    except psutil.Error:
        pass
    return snap


def record_gil(pid: int, seconds: int, path: Path) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record --gil --threads`` on ``pid`` (raw format into ``path``);
    None without py-spy."""
    spy = py_spy()
    if spy is None:
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--gil", "--threads",
                             "--rate", str(GIL_RATE), "--duration", str(seconds),
                             "--format", "raw", "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


_RAW_THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)(?:: ([^;]*))?")


def gil_samples(path: Path) -> tuple[dict[int, int], dict[int, str]]:
    """Samples holding the GIL by OS thread id, and the threads' names, from a py-spy raw
    (collapsed stacks) file recorded with ``--threads``: each line is
    ``thread (TID): NAME;frame;... COUNT``."""
    samples: defaultdict[int, int] = defaultdict(int)
    names: dict[int, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        m = _RAW_THREAD.match(stack)
        if not m or not count.isdigit():
            continue
        tid = int(m.group(1), 0)
        samples[tid] += int(count)
        if m.group(2):
            names[tid] = m.group(2)
    return dict(samples), names


@dataclass(slots=True)
class Measured:
    """One steady phase, per job where it says so."""

    jobs_per_s: float
    jobs: int
    failed: int
    seconds: float
    #: Calls by command over the phase (and usec).
    commands: dict[str, CommandStat]
    #: CPU ms per job by part: worker threads by name, then the other processes.
    cpu_ms: dict[str, float]
    #: GIL samples by worker thread; {} when py-spy did not run.
    gil: dict[str, int]
    gil_seconds: int
    gil_note: str = ""

    @property
    def calls_per_job(self) -> float:
        return sum(s.calls for s in self.commands.values()) / self.jobs

    @property
    def gil_share(self) -> float:
        """Share of wall time a worker thread held the GIL (NaN: not measured)."""
        total = sum(self.gil.values())
        return total / (GIL_RATE * self.gil_seconds) if self.gil else math.nan

    def gil_ms(self, samples: int) -> float:
        """GIL ms per job of ``samples`` (share of wall time / jobs per second)."""
        return samples / (GIL_RATE * self.gil_seconds) / self.jobs_per_s * 1000

    @property
    def worker_cpu_ms(self) -> float:
        return sum(v for k, v in self.cpu_ms.items() if k.startswith("worker thread "))


def cpu_per_job(before: Snapshot, after: Snapshot, jobs: int,
                names: Mapping[int, str]) -> dict[str, float]:
    """CPU ms per job by part, worker threads merged by name (the lanes stay apart)."""
    parts: defaultdict[str, float] = defaultdict(float)
    for key, end in after.cpu.items():
        ms = (end - before.cpu.get(key, 0.0)) * 1000 / jobs
        if key.startswith("thread:"):
            tid = int(key.split(":")[1])
            parts[f"worker thread {names.get(tid, f'{tid} (not Python)')}"] += ms
        else:
            parts[key] += ms
    workers = sorted(((k, v) for k, v in parts.items() if k.startswith("worker thread ")),
                     key=lambda kv: kv[1], reverse=True)
    others = [(k, parts[k]) for k in ("pool", "redis-server", "producers") if k in parts]
    return dict(workers + others)


def measure(args: argparse.Namespace) -> tuple[Measured, RedisRate | None, StartedWorker]:
    """The steady phase, then redis-benchmark on the same server (the worker stopped);
    also the worker (stopped), whose start-up log says what it chose."""
    worker_args = ["--model", MODEL, "--calibrate", "off", "--max-batch-size", str(MAX_BATCH),
                   "--max-inflight", str(args.window), *shlex.split(args.worker_args)]
    with RedisServer() as server:
        assert server.pid is not None
        worker = start_worker(server.url, MODEL, worker_args, "ceiling-worker.log")
        try:
            producers = Producers.start(produce, [
                (server.url, i, share, args.group)
                for i, share in enumerate(shares(args.window, args.producers))])
            try:
                m = steady_phase(args, server, worker.pid, producers)
            finally:
                producers.close(DRAIN_S)
        finally:
            worker.stop()
        bench = redis_benchmark(server.port)
    return m, bench, worker


def steady_phase(args: argparse.Namespace, server: RedisServer, worker_pid: int,
                 producers: Producers) -> Measured:
    warm_up(producers, args.warmup_s)
    wproc, sproc = psutil.Process(worker_pid), psutil.Process(server.pid)
    names = thread_names(worker_pid)
    gil_path = args.out_dir / "ceiling-gil.txt"
    gil_path.unlink(missing_ok=True)
    r = redis.Redis.from_url(server.url)
    try:
        before = snapshot(r, producers, wproc, sproc)
        spy = record_gil(worker_pid, args.gil_s, gil_path)
        time.sleep(max(0.0, before.at + args.seconds - time.perf_counter()))
        after = snapshot(r, producers, wproc, sproc)
    finally:
        r.close()
    gil, gil_names, note = read_gil(spy, gil_path)
    names.update(gil_names)  # a thread py-spy dump missed
    jobs = after.jobs - before.jobs
    if jobs <= 0:
        raise SystemExit("no job answered in the steady phase; see the worker's log "
                         f"{args.out_dir / 'ceiling-worker.log'}")
    return Measured(jobs / (after.at - before.at), jobs, after.failed - before.failed,
                    after.at - before.at, commands_between(before.stats, after.stats),
                    cpu_per_job(before, after, jobs, names), by_name(gil, names), args.gil_s,
                    note)


def by_name(samples: Mapping[int, int], names: Mapping[int, str]) -> dict[str, int]:
    """GIL samples merged by thread name (the lanes stay apart), most first."""
    out: defaultdict[str, int] = defaultdict(int)
    for tid, n in samples.items():
        out[names.get(tid, str(tid))] += n
    return dict(sorted(out.items(), key=lambda kv: kv[1], reverse=True))


def warm_up(producers: Producers, seconds: float) -> None:
    """Wait ``seconds``, then until a first job is answered (60 s at most)."""
    time.sleep(seconds)
    deadline = time.monotonic() + 60
    while producers.answered()[0] == 0:
        if time.monotonic() > deadline:
            raise SystemExit("no job answered after the warm-up; see the worker's log")
        time.sleep(0.2)


def read_gil(spy: subprocess.Popen[bytes] | None,
             path: Path) -> tuple[dict[int, int], dict[int, str], str]:
    """What :func:`gil_samples` reads once py-spy is done, and a note when it did not run."""
    if spy is None:
        return {}, {}, "py-spy is not installed (pip install py-spy)"
    rc = spy.wait()
    if rc != 0 or not path.exists():
        return {}, {}, f"py-spy record failed (exit code {rc}; it needs ptrace rights)"
    samples, names = gil_samples(path)
    return samples, names, "" if samples else "py-spy recorded no sample holding the GIL"


# ---------------------------------------------------------------------------- Redis's rate


@dataclass(frozen=True, slots=True)
class RedisRate:
    """Commands/s one Redis core does, and how that was measured."""

    per_s: float
    how: str


def redis_benchmark(port: int) -> RedisRate | None:
    """``redis-benchmark`` against the server on ``port``: the rate over all its tests
    (requests / the time they took). None without redis-benchmark or on failure."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    cmd = [exe, "-h", "127.0.0.1", "-p", str(port), "-P", str(BENCH_PIPELINE),
           "-c", str(BENCH_CLIENTS), "-n", str(BENCH_REQUESTS), "-t", BENCH_TESTS,
           "--dbnum", "1", "--csv"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    rates = [float(m) for m in re.findall(r'^"[A-Z]+[^"]*","([\d.]+)"', out.stdout, re.M)]
    if not rates:
        return None
    per_s = len(rates) / sum(1 / x for x in rates)
    return RedisRate(per_s, f"redis-benchmark -P {BENCH_PIPELINE} -c {BENCH_CLIENTS} "
                            f"-t {BENCH_TESTS} (rate over all)")


def rate_from_usec(commands: Mapping[str, CommandStat]) -> RedisRate:
    calls = sum(s.calls for s in commands.values())
    usec = sum(s.usec for s in commands.values())
    return RedisRate(calls / usec * 1e6 if usec else math.inf,
                     "commandstats usec_per_call of this workload (execution only, no I/O)")


# ---------------------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True)
class ModelRate:
    per_s: float
    what: str


def model_only(path: Path | None) -> ModelRate | None:
    """The best images/s of the profile's chosen variant; None without a profile."""
    if path is None:
        return None
    profile = load_profile(path)
    chosen = [m for m in profile.measured if m.variant == profile.choice.variant]
    rows = [r for m in (chosen or profile.measured) for r in m.rows]
    best = max(rows, key=lambda r: r.images_per_s)
    variant = chosen[0].variant.name if chosen else "any variant"
    return ModelRate(best.images_per_s,
                     f"{profile.model} {variant}, batch {best.batch_size}"
                     f"{f' x {best.batches_at_once} at once' if best.batches_at_once > 1 else ''}"
                     f" on {profile.device.kind} {profile.device.name} ({path.name})")


# ---------------------------------------------------------------------------- report


@dataclass(slots=True)
class Ceilings:
    worker: float
    worker_how: str
    redis_cpu: float
    redis_cmds: float
    redis_rate: RedisRate

    @property
    def redis(self) -> float:
        return min(self.redis_cpu, self.redis_cmds)


def ceilings(m: Measured, bench: RedisRate | None) -> Ceilings:
    if m.gil:
        worker = 1000 / m.gil_ms(sum(m.gil.values()))
        how = "1 / GIL-seconds per job"
    else:
        worker = 1000 / m.worker_cpu_ms
        how = f"1 / worker CPU-seconds per job ({m.gil_note})"
    redis_ms = m.cpu_ms.get("redis-server", 0.0)
    rate = bench or rate_from_usec(m.commands)
    return Ceilings(worker, how, 1000 / redis_ms if redis_ms > 0 else math.inf,
                    rate.per_s / m.calls_per_job, rate)


def print_measured(args: argparse.Namespace, m: Measured, described: str) -> None:
    print(f"cores={psutil.cpu_count()} producers={args.producers} window={args.window} "
          f"group={args.group} seconds={args.seconds:g} worker_args={args.worker_args!r}")
    print(f"worker: {described}")
    print(f"measured {m.jobs_per_s:.1f} jobs/s ({m.jobs} jobs in {m.seconds:.1f} s, "
          f"{m.failed} failed)")
    print(f"Redis calls per job: {m.calls_per_job:.2f} (INFO commandstats, script calls "
          f"included)")
    print("  top commands: calls per job (us per call)")
    for name, s in list(m.commands.items())[:12]:
        print(f"  {name:20s} {s.calls / m.jobs:6.2f}  ({s.usec / s.calls:5.1f} us/call)")
    print(f"{'CPU per job':44s} {'CPU ms':>8} {'GIL ms':>8}")
    for part, ms in m.cpu_ms.items():
        thread = part.removeprefix("worker thread ")
        gil = f"{m.gil_ms(m.gil[thread]):8.3f}" if thread in m.gil else f"{'':8s}"
        print(f"{part:44s} {ms:8.3f} {gil}")
    for thread, samples in m.gil.items():  # holders psutil did not list (short-lived)
        if f"worker thread {thread}" not in m.cpu_ms:
            print(f"{'worker thread ' + thread:44s} {'':8s} {m.gil_ms(samples):8.3f}")
    gil_total = m.gil_ms(sum(m.gil.values())) if m.gil else math.nan
    print(f"{'worker process (all its threads)':44s} {m.worker_cpu_ms:8.3f} {gil_total:8.3f}")
    if m.gil:
        print(f"GIL held {m.gil_share:.0%} of the time ({sum(m.gil.values())} of "
              f"{GIL_RATE * m.gil_seconds} py-spy samples in {m.gil_seconds} s); GIL ms per "
              f"job = that share / {m.jobs_per_s:.1f} jobs/s")
    else:
        print(f"GIL time not measured: {m.gil_note}")


def print_projections(m: Measured, c: Ceilings, model: ModelRate | None) -> None:
    print(f"ceiling of one worker: {c.worker:.0f} jobs/s ({c.worker_how}); measured "
          f"{m.jobs_per_s:.0f} = {m.jobs_per_s / c.worker:.2f} of it")
    print(f"ceiling of one Redis:  {c.redis:.0f} jobs/s, the lower of {c.redis_cpu:.0f} "
          f"by its CPU and {c.redis_cmds:.0f} by its commands")
    print(f"  by its CPU: 1 / redis-server CPU {m.cpu_ms.get('redis-server', 0.0):.3f} ms "
          f"per job; by its commands: {c.redis_rate.per_s:.0f} commands/s one core does "
          f"({c.redis_rate.how}) / {m.calls_per_job:.2f} calls per job")
    if model is None:
        print("model alone: skipped, no calibration profile given (--profile PATH of "
              "`redbatch calibrate`)")
    else:
        print(f"model alone: {model.per_s:.0f} img/s ({model.what})")


def print_pool(m: Measured, processes: str) -> None:
    """The pool's share, for reference: it scales with its processes (one GIL each), and
    photos cost far more to decode than the null model's 32x32 JPEGs."""
    ms = m.cpu_ms.get("pool", 0.0)
    if ms <= 0 or not processes.isdigit():
        return
    print(f"for reference, the pool: {ms:.3f} CPU-ms per job (decoding 32x32 JPEGs and the "
          f"hand-offs), so its {processes} process(es) allow at most "
          f"{int(processes) * 1000 / ms:.0f} jobs/s (not counted in the limit below)")


def limit_line(c: Ceilings, model: ModelRate | None) -> str:
    parts = {"one worker (its GIL)": c.worker, "one Redis": c.redis}
    lowest = min(parts, key=lambda k: parts[k])
    if model is None:
        return (f"LIMIT without a profile: of redbatch's parts, {lowest} at "
                f"{parts[lowest]:.0f} jobs/s")
    if model.per_s < min(parts.values()):
        return (f"LIMIT: the device is the limit: the model alone does {model.per_s:.0f} "
                f"img/s, below one worker ({c.worker:.0f}) and one Redis ({c.redis:.0f})")
    return (f"LIMIT: {lowest} is the limit at {parts[lowest]:.0f} jobs/s, below the model "
            f"alone ({model.per_s:.0f} img/s)")


def report(args: argparse.Namespace, m: Measured, bench: RedisRate | None,
           worker: StartedWorker, model: ModelRate | None) -> None:
    c = ceilings(m, bench)
    print_measured(args, m, worker.describe())
    print_projections(m, c, model)
    print_pool(m, worker.ready.get("pool", ""))
    write_outputs(m, c, model)
    print(machine_load())
    print(f"wrote {args.out_dir / 'ceiling.csv'}, {args.out_dir / 'ceiling.png'}")
    if model is not None:
        print(f"RATIO model alone / one-worker ceiling = {model.per_s:.0f} / {c.worker:.0f} = "
              f"{model.per_s / c.worker:.2f}")
        print(f"RATIO model alone / one-Redis ceiling  = {model.per_s:.0f} / {c.redis:.0f} = "
              f"{model.per_s / c.redis:.2f}")
    print(f"RATIO measured / one-worker ceiling = {m.jobs_per_s:.0f} / {c.worker:.0f} = "
          f"{m.jobs_per_s / c.worker:.2f}")
    print(limit_line(c, model))


def write_outputs(m: Measured, c: Ceilings, model: ModelRate | None) -> None:
    rows: list[list[str]] = [
        ["rate", "measured", fmt(m.jobs_per_s), "jobs/s"],
        ["rate", "one worker ceiling", fmt(c.worker), "jobs/s"],
        ["rate", "one Redis ceiling (CPU)", fmt(c.redis_cpu), "jobs/s"],
        ["rate", "one Redis ceiling (commands)", fmt(c.redis_cmds), "jobs/s"],
        ["rate", "Redis commands per core", fmt(c.redis_rate.per_s), "commands/s"],
        ["redis", "calls per job", fmt(m.calls_per_job, 2), "calls/job"],
        *[["redis", name, fmt(s.calls / m.jobs, 3), "calls/job"]
          for name, s in m.commands.items()],
        *[["cpu", part, fmt(ms, 3), "ms/job"] for part, ms in m.cpu_ms.items()],
        ["gil", "share of wall time", fmt(m.gil_share, 3), "share"],
        *[["gil", thread, fmt(m.gil_ms(n), 3), "ms/job"] for thread, n in m.gil.items()],
    ]
    rates = {"redbatch measured (null model)": m.jobs_per_s,
             "redbatch: one worker ceiling": c.worker, "redbatch: one Redis ceiling": c.redis}
    if model is not None:
        rows.append(["rate", "model alone", fmt(model.per_s), "img/s"])
        rates["model alone (calibration)"] = model.per_s
    write_csv("ceiling.csv", ["section", "name", "value", "unit"], rows)
    plot_rates("ceiling.png", rates, f"one worker and one Redis against the model alone; "
               f"{m.calls_per_job:.1f} Redis calls per job", "jobs/s", "%.0f", 3.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="steady phase, s")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--producers", type=int, default=4, help="producer processes")
    parser.add_argument("--window", type=int, default=1024,
                        help="jobs in flight over all producers (and the worker's --max-inflight)")
    parser.add_argument("--group", type=int, default=64, help="jobs per pipelined submit")
    parser.add_argument("--gil-s", type=int, default=5, help="py-spy --gil sampling, s")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a `redbatch calibrate` profile (JSON): the model-only rate")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    parser.add_argument("--out-dir", type=Path, default=OUT,
                        help="where the CSV, PNG and logs go (default bench/out)")
    args = parser.parse_args()
    args.gil_s = max(1, min(args.gil_s, int(args.seconds) - 1))
    reexec_with_worker_malloc()
    args.out_dir = set_out_dir(args.out_dir)
    model = model_only(args.profile)  # a bad profile fails before anything starts
    measured, bench, worker = measure(args)
    report(args, measured, bench, worker, model)


if __name__ == "__main__":
    main()
