"""One model end to end through Redis, for bench/gpu_check.sh: capacity, CPU and Redis calls
per job, then p99 at a share of that capacity.

    python bench/gpu_e2e.py --model efficientnet_lite0 --payload photos --device cuda \
        --name image --out-dir DIR [--seconds 10] [--producers 4] [--window 1024]

One private redis-server, one ``redbatch worker`` (its log in DIR/NAME-worker.log; it loads
the profile in REDBATCH_PROFILE_DIR like any worker) and --producers processes, each a
closed loop of the real Client keeping its share of --window jobs in flight. Payloads:
``photos`` (samples/, decoded in the pool), ``tiny`` (32x32 JPEGs), ``tensors``
(null_tensor's four floats) or ``texts`` (real sentences cut to a long-tailed mix of
lengths). Over the steady phase it reads jobs/s, the worker's CPU ms per job (its own
process, and its pool), redis-server's, and the Redis calls per job (INFO commandstats);
then Poisson arrivals at --load x that capacity for --load-s, timed from each scheduled
arrival: p50/p99. The steady phase runs on past --seconds (up to 10x) until --min-jobs
are answered. Writes DIR/NAME.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shlex
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psutil
import redis
from harness import (
    Collector,
    RedbatchTarget,
    command_stats,
    commands_between,
    latency_summary,
    open_loop,
    photos,
    set_out_dir,
    start_worker,
    tensors,
    tiny_jpegs,
)
from producers import Producers, shares
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import model_name_from_spec

#: Jobs a producer submits per pipelined call.
GROUP = 64
#: Longest the producers wait for their last answers, s.
DRAIN_S = 30.0


def payloads(kind: str, seed: int) -> list[bytes | str]:
    """What a producer sends (see the module docstring)."""
    if kind == "photos":
        return list(photos())
    if kind == "tiny":
        return list(tiny_jpegs(200, seed=seed))
    if kind == "tensors":
        return list(tensors(300, seed=seed))
    from bucketing import text_lengths, texts_of_lengths  # the tokenizer: texts only

    return list(texts_of_lengths(text_lengths(300, seed), seed + 1))


def produce(url: str, model: str, kind: str, index: int, window: int,
            counts: ctypes.Array[ctypes.c_longlong], stop: Event) -> None:
    """A producer process: ``window`` jobs in flight until ``stop``; counts answered and
    failed jobs in ``counts[2 * index]`` and ``counts[2 * index + 1]``."""
    target = RedbatchTarget(url, model, payloads(kind, 1000 + index))
    collector = Collector(url, target)
    inflight: set[str] = set()

    def submit(n: int) -> None:
        for start in range(0, n, GROUP):
            inflight.update(target.submit(min(GROUP, n - start)))

    try:
        submit(window)
        deadline = float("inf")
        while inflight and time.monotonic() < deadline:
            done = [f for f in collector.poll(0.5) if f.rid in inflight]
            inflight.difference_update(f.rid for f in done)
            failed = sum(not f.ok for f in done)
            counts[2 * index] += len(done) - failed
            counts[2 * index + 1] += failed
            if stop.is_set():
                deadline = min(deadline, time.monotonic() + DRAIN_S)
            elif done:
                submit(len(done))
    finally:
        collector.close()
        target.close()


def cpu_s(p: psutil.Process, children: bool = False) -> float:
    try:
        procs = p.children(recursive=True) if children else [p]
        return sum(c.cpu_times().user + c.cpu_times().system for c in procs)
    except psutil.Error:
        return 0.0


def pool_processes(worker: psutil.Process) -> int:
    """The worker's pool processes (spawned children, not multiprocessing's resource
    tracker)."""
    try:
        found = 0
        for child in worker.children(recursive=True):
            line = " ".join(child.cmdline())
            found += "spawn_main" in line and "resource_tracker" not in line
        return found
    except psutil.Error:
        return 0


def snapshot(r: redis.Redis, producers: Producers, worker: psutil.Process,
             server: psutil.Process) -> dict[str, Any]:
    jobs, failed = producers.answered()
    return {"at": time.perf_counter(), "jobs": jobs, "failed": failed,
            "stats": command_stats(r), "worker": cpu_s(worker),
            "pool": cpu_s(worker, children=True), "redis": cpu_s(server)}


def steady(args: argparse.Namespace, server: RedisServer, worker_pid: int,
           model: str) -> dict[str, Any]:
    """Warm-up, then the recorded phase: capacity and what each job cost."""
    r = redis.Redis.from_url(server.url)
    assert server.pid is not None
    wproc, sproc = psutil.Process(worker_pid), psutil.Process(server.pid)
    producers = Producers.start(produce, [
        (server.url, model, args.payload, i, max(1, share))
        for i, share in enumerate(shares(args.window, args.producers))])
    try:
        started = time.monotonic()  # spawned producers take seconds to import and connect
        while producers.answered()[0] < args.producers and time.monotonic() - started < 60:
            time.sleep(0.1)
        time.sleep(args.warmup_s)
        a = snapshot(r, producers, wproc, sproc)
        time.sleep(args.seconds)
        # A slow or busy machine: longer, until --min-jobs are answered (at most 10x).
        until = time.monotonic() + 9 * args.seconds
        while producers.answered()[0] - a["jobs"] < args.min_jobs and time.monotonic() < until:
            time.sleep(0.1)
        b = snapshot(r, producers, wproc, sproc)
    finally:
        producers.close(DRAIN_S)
        r.close()
    jobs, span = max(1, b["jobs"] - a["jobs"]), b["at"] - a["at"]
    calls = commands_between(a["stats"], b["stats"])
    processes = pool_processes(wproc)
    return {"jobs": b["jobs"] - a["jobs"], "failed": b["failed"] - a["failed"],
            "jobs_per_s": (b["jobs"] - a["jobs"]) / span,
            "worker_cpu_ms": (b["worker"] - a["worker"]) * 1000 / jobs,
            "pool_cpu_ms": (b["pool"] - a["pool"]) * 1000 / jobs,
            "pool_processes": processes,
            # Each pool process's share of a core: decoding is CPU, so well under 1 means
            # the processes waited for work (the worker's refill), not that they were slow.
            "pool_busy": (b["pool"] - a["pool"]) / span / processes if processes else 0.0,
            "redis_cpu_ms": (b["redis"] - a["redis"]) * 1000 / jobs,
            "redis_cpu_share": (b["redis"] - a["redis"]) / span,
            "redis_calls_per_job": sum(s.calls for s in calls.values()) / jobs,
            "top_calls_per_job": {k: round(s.calls / jobs, 3)
                                  for k, s in list(calls.items())[:6]}}


def at_load(args: argparse.Namespace, url: str, model: str, capacity: float) -> dict[str, Any]:
    rate = max(1.0, args.load * capacity)
    target = RedbatchTarget(url, model, payloads(args.payload, 7))
    try:
        run = open_loop(url, target, rate, args.load_s, seed=3, drain_timeout_s=60)
    finally:
        target.close()
    lat = latency_summary(run.latencies())
    return {"load": args.load, "offered_per_s": rate, "achieved_per_s": run.achieved,
            "p50_ms": lat["p50"], "p99_ms": lat["p99"], "failed_at_load": run.failed,
            "max_submit_lag_ms": run.max_submit_lag_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--payload", choices=("photos", "tiny", "tensors", "texts"), required=True)
    p.add_argument("--name", required=True, help="file names: NAME.json, NAME-worker.log")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=10.0, help="steady phase, s")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--min-jobs", type=int, default=20,
                   help="the steady phase lasts until this many are answered")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--window", type=int, default=1024, help="jobs in flight in all")
    p.add_argument("--load", type=float, default=0.7, help="share of capacity for the p99")
    p.add_argument("--load-s", type=float, default=5.0)
    p.add_argument("--worker-args", default="")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args()
    out = set_out_dir(args.out_dir)
    model = model_name_from_spec(args.model)
    result: dict[str, Any] = {"name": args.name, "model": args.model,
                              "payload": args.payload, "device": args.device}
    worker_args = ["--model", args.model, "--device", args.device,
                   "--max-inflight", str(args.window), *shlex.split(args.worker_args)]
    with RedisServer() as server:
        worker = start_worker(server.url, model, worker_args, f"{args.name}-worker.log")
        try:
            result["worker"] = worker.describe()
            result.update(steady(args, server, worker.pid, model))
            result.update(at_load(args, server.url, model, result["jobs_per_s"]))
        finally:
            result["worker_exit"] = worker.stop()
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "top_calls_per_job"}))


if __name__ == "__main__":
    main()
