"""Max batch size sweep 1, 2, 4, ... 64, one variable at a time: a fresh worker per size.

    .venv/bin/python bench/batch_sweep.py [--sizes 1,2,4,8,16,32,64] [--seconds 15]
                                          [--window 128] [--model efficientnet_lite0]

One private redis-server. First a worker starts as shipped and stops again, so that its
calibration profile exists (loaded, or measured and stored); then for each size a new
`redbatch worker --calibrate load --max-batch-size SIZE`, with everything else fixed
(--max-inflight = --window, the max wait, pool and threads, the model variant from that one
profile, the same photos), so only the max batch size changes. Per size:

1. warm-up: the closed loop for --warmup-s, not recorded;
2. steady phase: the closed loop keeps --window jobs in flight for --seconds; requests
   answered in this phase are the row's requests, duration and latencies (client side, from
   submit to the answer seen: with a full window, Little's law makes the mean about
   window / throughput);
3. drain: no new jobs; the worker finishes what it holds, then stops.

Peak memory is the largest RSS of the worker plus its pool processes, sampled every 0.2 s
from its start (model load and warm-up of the size included) to its stop.

Prints a row per size and, last, each size's throughput relative to batch 1 and to the best
size. Writes bench/out/batch_sweep.csv and bench/out/batch_sweep.png (--out-dir: elsewhere).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from harness import (
    MIB,
    OUT,
    ClosedRun,
    RedbatchTarget,
    RssSampler,
    StartedWorker,
    closed_loop,
    fmt,
    latency_summary,
    machine_load,
    photos,
    plot,
    reexec_with_worker_malloc,
    set_out_dir,
    start_worker,
    tiny_jpegs,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import DEFAULT_MAX_WAIT_MS, model_name_from_spec


@dataclass(slots=True)
class SizeResult:
    size: int
    run: ClosedRun
    peak_rss: int
    worker: StartedWorker

    def compute_ms(self) -> float:
        """Median model time of the largest batches formed (ms); NaN when none ran."""
        if not self.run.steady:
            return float("nan")
        largest = max(c.finished.batch_size for c in self.run.steady)
        return statistics.median(c.finished.inference_ms for c in self.run.steady
                                 if c.finished.batch_size == largest)

    def mean_batch(self) -> float:
        if not self.run.steady:
            return float("nan")
        return statistics.fmean(c.finished.batch_size for c in self.run.steady)


def settle(url: str, args: argparse.Namespace) -> StartedWorker:
    """Start and stop a worker as shipped, so that a profile exists for the sweep to load."""
    worker = start_worker(url, model_name_from_spec(args.model),
                          ["--model", args.model, *shlex.split(args.worker_args)],
                          "batch_sweep-worker-settle.log")
    worker.stop()
    return worker


def one_size(url: str, size: int, args: argparse.Namespace) -> SizeResult:
    name = model_name_from_spec(args.model)
    # RSS from the spawn on: the model load and the warm-up of the size count too.
    with RssSampler(0) as rss:
        worker = start_worker(url, name, ["--model", args.model, "--calibrate", "load",
                                          "--max-batch-size", str(size), "--max-inflight",
                                          str(args.window), "--max-wait-ms",
                                          str(args.max_wait_ms),
                                          *shlex.split(args.worker_args)],
                              f"batch_sweep-worker-{size}.log", on_spawn=rss.watch)
        try:
            payloads = tiny_jpegs(300) if args.model == "null" else photos()
            target = RedbatchTarget(url, name, payloads)
            run = closed_loop(url, target, args.window, args.seconds, warmup_s=args.warmup_s)
            target.close()
        finally:
            worker.stop()
    if not run.steady:
        print(f"WARNING: no answer in the steady phase at size {size}; see {worker.log}")
    return SizeResult(size, run, rss.peak, worker)


def report(args: argparse.Namespace, results: list[SizeResult]) -> None:
    header = ["max_batch_size", "requests", "duration_s", "mean_ms", "p50_ms", "p95_ms",
              "p99_ms", "max_ms", "throughput_per_s", "peak_rss_mib", "mean_batch_size",
              "compute_ms_largest_batch", "drain_s", "window", "max_wait_ms", "variant"]
    rows = []
    for r in results:
        lat = latency_summary(r.run.latencies())
        rows.append([r.size, len(r.run.steady), fmt(r.run.steady_s, 2),
                     *(fmt(lat[k]) for k in ("mean", "p50", "p95", "p99", "max")),
                     fmt(r.run.throughput, 2), fmt(r.peak_rss / MIB), fmt(r.mean_batch(), 2),
                     fmt(r.compute_ms()), fmt(r.run.drain_s, 2), args.window,
                     args.max_wait_ms, r.worker.variant])
    write_csv("batch_sweep.csv", header, rows)
    draw(args, results)
    print(f"cores={os.cpu_count()} model={args.model} window=max_inflight={args.window} "
          f"max_wait_ms={args.max_wait_ms:g} seconds={args.seconds:g} "
          f"worker_args={args.worker_args!r}")
    print(f"{'size':>4} {'n':>5} {'req/s':>7} {'mean':>7} {'p50':>7} {'p95':>7} {'p99':>7} "
          f"{'max':>7} {'peak MiB':>8} {'batch':>6} {'model ms':>8}")
    for r in results:
        lat = latency_summary(r.run.latencies())
        print(f"{r.size:4d} {len(r.run.steady):5d} {r.run.throughput:7.1f} {lat['mean']:7.0f} "
              f"{lat['p50']:7.0f} {lat['p95']:7.0f} {lat['p99']:7.0f} {lat['max']:7.0f} "
              f"{r.peak_rss / MIB:8.0f} {r.mean_batch():6.1f} {r.compute_ms():8.1f}")
    print(machine_load())
    print(f"wrote {args.out_dir / 'batch_sweep.csv'}, {args.out_dir / 'batch_sweep.png'}")
    variants = sorted({r.worker.variant for r in results})
    print(f"model variant (from the profile): {', '.join(variants)}"
          + ("  WARNING: it changed during the sweep" if len(variants) > 1 else ""))
    first = results[0].run.throughput
    best = max(results, key=lambda r: r.run.throughput)
    print(f"best max batch size: {best.size} ({best.run.throughput:.1f} req/s)")
    print("RATIO throughput / size " + str(results[0].size) + ": "
          + "  ".join(f"{r.size}={r.run.throughput / first:.2f}" for r in results))
    print("RATIO throughput / best:   "
          + "  ".join(f"{r.size}={r.run.throughput / best.run.throughput:.2f}"
                      for r in results))


def draw(args: argparse.Namespace, results: list[SizeResult]) -> None:
    sizes = [r.size for r in results]
    lats = [latency_summary(r.run.latencies()) for r in results]

    def figure(plt):  # type: ignore[no-untyped-def]
        fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
        a1.plot(sizes, [r.run.throughput for r in results], "o-")
        a1.set_ylabel("throughput, req/s")
        for key in ("p50", "p95", "p99"):
            a2.plot(sizes, [s[key] for s in lats], "o-", label=key)
        a2.set_ylabel("latency, ms")
        a2.legend()
        a3.plot(sizes, [r.peak_rss / MIB for r in results], "o-", color="tab:purple")
        a3.set_ylabel("peak RSS, MiB\n(worker + pool)")
        a3.set_xscale("log", base=2)
        a3.set_xticks(sizes, [str(s) for s in sizes])
        a3.set_xlabel("max batch size")
        for ax in (a1, a2, a3):
            ax.grid(alpha=0.3)
        a1.set_title(f"{args.model} on {os.cpu_count()} CPU cores: closed loop, "
                     f"{args.window} in flight, max wait {args.max_wait_ms:g} ms, "
                     f"{args.seconds:g} s per size", fontsize=9)

    plot("batch_sweep.png", figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--seconds", type=float, default=15.0, help="steady phase per size")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window", type=int, default=128,
                        help="jobs in flight, also the worker's --max-inflight")
    parser.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS)
    parser.add_argument("--model", default="efficientnet_lite0",
                        help="worker --model (null: tiny JPEGs, what redbatch itself costs)")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    parser.add_argument("--out-dir", type=Path, default=OUT,
                        help="folder for the CSV, the plot and the worker logs "
                             "(default: bench/out)")
    args = parser.parse_args()
    args.out_dir = set_out_dir(args.out_dir)
    sizes = [int(x) for x in args.sizes.split(",")]
    if max(sizes) > args.window:
        parser.error("--window must be at least the largest size")
    reexec_with_worker_malloc()
    results = []
    with RedisServer() as server:
        shipped = settle(server.url, args)
        print(f"worker as shipped: {shipped.describe()}", flush=True)
        for line in shipped.tuning:
            print(f"  tuning: {line}", flush=True)
        for size in sizes:
            results.append(one_size(server.url, size, args))
            r = results[-1]
            print(f"  size {size:3d}: {r.run.throughput:6.1f} req/s, peak "
                  f"{r.peak_rss / MIB:.0f} MiB", flush=True)
    report(args, results)


if __name__ == "__main__":
    main()
