"""End-to-end throughput against two baselines, measured in one run on this machine.

    .venv/bin/python bench/throughput.py [--images 600] [--max-batch-size 8]

1. ideal:  one process decodes, batches and runs the same model in a plain loop, no Redis,
           all cores for torch (what you would write by hand for an offline job);
2. redbatch: a private redis-server and one `redbatch worker` process (its defaults for the
           pool and torch threads); a client submits every image at once and waits for all;
3. one-at-a-time: the same model serving one request at a time, decode then forward, batch 1,
           in process (no Redis);
4. redbatch, batch 1: the same worker with --max-batch-size 1 (what batching adds inside redbatch).

All three run under the same malloc settings (the worker's, see common/malloc_tuning.py):
the script re-executes itself with them, so the comparison is of the pipeline, not of glibc.

Prints throughputs, the two ratios (redbatch / ideal, redbatch / one-at-a-time), latency
percentiles and the batch-size histogram, and writes bench/out/throughput.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from redbatch.common import malloc_tuning
from redbatch.common.config import LimitSettings
from redbatch.common.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.common.protocol import Keys
from redbatch.common.redis_server import RedisServer
from redbatch.gpu_worker.handlers import EfficientNetLite0
from redbatch.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"


def workload(n: int) -> list[bytes]:
    photos = [p.read_bytes() for p in sorted((ROOT / "samples").glob("*.jpg"))]
    return [photos[i % len(photos)] for i in range(n)]


def in_process(payloads: list[bytes], batch_size: int) -> float:
    """Images per second of a plain decode-batch-forward loop in this process."""
    torch.set_num_threads(os.cpu_count() or 1)
    handler = EfficientNetLite0(LimitSettings())
    model = handler.load(torch.device("cpu"))
    buf = np.empty((batch_size, *handler.input_shape), np.float32)
    with torch.inference_mode():
        model(torch.from_numpy(buf[:batch_size]))  # warm-up
        start = time.perf_counter()
        for i in range(0, len(payloads), batch_size):
            chunk = payloads[i:i + batch_size]
            for j, data in enumerate(chunk):
                handler.preprocess(data, "", {}, buf[j])
            handler.postprocess(model(torch.from_numpy(buf[:len(chunk)])), [{}] * len(chunk))
    return len(payloads) / (time.perf_counter() - start)


def through_redbatch(payloads: list[bytes], batch_size: int,
                     extra: list[str]) -> tuple[float, list[float], Counter[int]]:
    """Images per second through Redis and one worker process, plus latencies and batch sizes."""
    keys = Keys("efficientnet_lite0")
    with RedisServer() as server:
        worker = spawn_worker(server.url, ["--max-batch-size", str(batch_size),
                                           "--log-level", "WARNING", *extra])
        try:
            wait_worker_ready(server.url, keys, worker)
            with Client(server.url) as client:
                client.predict(payloads[0], timeout_s=120)  # first-request costs out of the way
                start = time.perf_counter()
                ids = client.submit_many(payloads, timeout_s=3600)
                results = [client.result(i, timeout_s=3600) for i in ids]
                elapsed = time.perf_counter() - start
        finally:
            stop_worker(worker)
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    latencies = [r.timings["total_ms"] for r in results]
    return len(payloads) / elapsed, latencies, Counter(r.batch_size for r in results)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    args = parser.parse_args()
    if malloc_tuning.wanted():
        env = {**os.environ, **malloc_tuning.MALLOC_ENV}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    payloads = workload(args.images)

    ideal = in_process(payloads, args.max_batch_size)
    single = in_process(payloads[: max(50, args.images // 4)], 1)
    extra = shlex.split(args.worker_args)
    ours, latencies, sizes = through_redbatch(payloads, args.max_batch_size, extra)
    ours_single, _, _ = through_redbatch(payloads[: max(50, args.images // 2)], 1, extra)

    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "throughput.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "images", "max_batch_size", "images_per_s"])
        w.writerow(["ideal_in_process", args.images, args.max_batch_size, f"{ideal:.2f}"])
        w.writerow(["one_at_a_time", max(50, args.images // 4), 1, f"{single:.2f}"])
        w.writerow(["redbatch", args.images, args.max_batch_size, f"{ours:.2f}"])
        w.writerow(["redbatch_batch_1", max(50, args.images // 2), 1, f"{ours_single:.2f}"])
    print(f"cores={os.cpu_count()} images={args.images} max_batch_size={args.max_batch_size} "
          f"worker_args={args.worker_args!r} ({malloc_tuning.describe()})")
    print(f"ideal in-process loop      {ideal:8.1f} img/s")
    print(f"one request at a time      {single:8.1f} img/s")
    print(f"redbatch end to end        {ours:8.1f} img/s")
    print(f"redbatch, max batch 1      {ours_single:8.1f} img/s")
    print(f"latency under saturation   p50 {pct(latencies, 50):.0f} ms  p95 "
          f"{pct(latencies, 95):.0f} ms  p99 {pct(latencies, 99):.0f} ms  "
          f"(mean {statistics.fmean(latencies):.0f} ms)")
    print(f"requests by batch size     {dict(sorted(sizes.items()))}")
    print(f"RATIO redbatch / ideal in-process       = {ours / ideal:.2f}")
    print(f"RATIO redbatch / one-at-a-time serving  = {ours / single:.2f}")
    print(f"RATIO redbatch / redbatch at batch 1    = {ours / ours_single:.2f}")


if __name__ == "__main__":
    main()
