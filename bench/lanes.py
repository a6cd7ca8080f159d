"""Interactive latency alone and while a bulk run drains on the same worker, in one run.

    .venv/bin/python bench/lanes.py [--rate 10] [--seconds 30] [--worker-args "..."]

One private redis-server and one `redbatch worker` (default model and settings unless
--worker-args says otherwise). Three phases:

1. interactive alone: Poisson arrivals at --rate requests/s for --seconds;
2. the same interactive load while a bulk backlog (large enough to outlast the phase)
   drains on the same worker;
3. bulk alone, for reference throughput.

Prints interactive p50/p95/p99 for 1 and 2, bulk throughput in 2 and 3, and last the
ratio p99(with bulk) / p99(alone) (target <= 1.5). Writes bench/out/lanes.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import Keys, Lane
from redbatch.gpu_worker.device import malloc_tuning
from redbatch.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
KEYS = Keys("efficientnet_lite0")


def photos() -> list[bytes]:
    return [p.read_bytes() for p in sorted((ROOT / "samples").glob("*.jpg"))]


def interactive_phase(url: str, rate: float, seconds: float, seed: int) -> list[float]:
    """Open-loop Poisson arrivals; returns client-side latencies in ms."""
    rng = random.Random(seed)
    payloads = photos()
    latencies: list[float] = []
    lock = threading.Lock()
    local = threading.local()

    def one(data: bytes) -> None:
        if not hasattr(local, "client"):
            local.client = Client(url)
        start = time.perf_counter()
        result = local.client.predict(data, timeout_s=60)
        assert result.ok, result
        with lock:
            latencies.append((time.perf_counter() - start) * 1000)

    with ThreadPoolExecutor(max_workers=64) as pool:
        t0 = time.perf_counter()
        at = 0.0
        while at < seconds:
            at += rng.expovariate(rate)
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, rng.choice(payloads))
    return latencies


class BulkLoad:
    """A bulk backlog submitted up front; counts completions from its reply list."""

    def __init__(self, url: str, jobs: int) -> None:
        self.client = Client(url)
        self.reply = KEYS.reply("bench-bulk")
        payloads = photos()
        envelopes = [self.client.job(payloads[i % len(payloads)], lane=Lane.BULK,
                                     reply_to=self.reply) for i in range(jobs)]
        for i in range(0, jobs, 500):
            self.client.submit_jobs(envelopes[i:i + 500])
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._count, daemon=True)
        self._thread.start()

    def _count(self) -> None:
        r = redis.Redis.from_url(self.client.redis_url)
        while not self._stop.is_set():
            if r.blpop([self.reply], timeout=0.5):
                self.done += 1 + len(r.lpop(self.reply, 1000) or [])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def bulk_rate(bulk: BulkLoad, seconds: float) -> float:
    start = bulk.done
    time.sleep(seconds)
    return (bulk.done - start) / seconds


def run(args: argparse.Namespace) -> None:
    with RedisServer() as server:
        worker = spawn_worker(server.url, ["--log-level", "WARNING",
                                           *shlex.split(args.worker_args)])
        try:
            wait_worker_ready(server.url, KEYS, worker)
            interactive_phase(server.url, args.rate, 3, seed=0)  # warm-up
            alone = interactive_phase(server.url, args.rate, args.seconds, seed=1)
            bulk = BulkLoad(server.url, args.bulk_jobs)
            time.sleep(2)  # let the bulk lane fill the worker
            start_done = bulk.done
            t0 = time.perf_counter()
            mixed = interactive_phase(server.url, args.rate, args.seconds, seed=2)
            bulk_with = (bulk.done - start_done) / (time.perf_counter() - t0)
            bulk_alone = bulk_rate(bulk, min(args.seconds, 15))
            left = args.bulk_jobs - bulk.done
            bulk.close()
        finally:
            stop_worker(worker)
    report(args, alone, mixed, bulk_with, bulk_alone, left)


def report(args: argparse.Namespace, alone: list[float], mixed: list[float],
           bulk_with: float, bulk_alone: float, left: int) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "lanes.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["phase", "requests", "p50_ms", "p95_ms", "p99_ms", "bulk_per_s"])
        w.writerow(["interactive_alone", len(alone), *(f"{pct(alone, q):.1f}" for q in
                                                        (50, 95, 99)), ""])
        w.writerow(["interactive_with_bulk", len(mixed), *(f"{pct(mixed, q):.1f}" for q in
                                                            (50, 95, 99)), f"{bulk_with:.1f}"])
        w.writerow(["bulk_alone", "", "", "", "", f"{bulk_alone:.1f}"])
    print(f"cores={os.cpu_count()} rate={args.rate}/s seconds={args.seconds} "
          f"worker_args={args.worker_args!r} bulk backlog left at the end: {left}")
    for name, lat in (("interactive alone", alone), ("interactive with bulk", mixed)):
        print(f"{name:24s} n={len(lat):4d}  p50 {pct(lat, 50):6.1f} ms  p95 "
              f"{pct(lat, 95):6.1f} ms  p99 {pct(lat, 99):6.1f} ms")
    print(f"bulk throughput while interactive runs  {bulk_with:6.1f} img/s")
    print(f"bulk throughput alone                   {bulk_alone:6.1f} img/s")
    if left <= 0:
        print("WARNING: the bulk backlog ran out; raise --bulk-jobs")
    print(f"RATIO interactive p99 with bulk / alone = {pct(mixed, 99) / pct(alone, 99):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="interactive requests/s")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--bulk-jobs", type=int, default=4000)
    parser.add_argument("--worker-args", default="")
    args = parser.parse_args()
    if malloc_tuning.wanted():  # the client side under the worker's malloc settings too
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **malloc_tuning.MALLOC_ENV})
    run(args)


if __name__ == "__main__":
    main()
