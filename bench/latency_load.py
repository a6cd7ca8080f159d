"""Latency against offered load: open-loop Poisson arrivals from 10% to 100% of capacity.

    .venv/bin/python bench/latency_load.py [--seconds 12] [--levels 0.1,0.2,...,1.0]
                                           [--max-batch-size N] [--max-wait-ms 5]

One private redis-server and one `redbatch worker` (EfficientNet-Lite0) as shipped: its
calibration profile picks the max batch size and model variant unless --max-batch-size is
given; --max-wait-ms is passed when given; --worker-args adds more flags. The output states
the max batch and max wait the worker reports in its start-up log (bench/out/
latency_load-worker.log). The sample photos are the payloads.

1. warm-up: a few seconds of saturated traffic, not recorded;
2. capacity: a closed loop keeping --window jobs in flight (default: the worker's
   max in-flight) for --capacity-s; capacity = answers per second. The batch compute time
   is the median ``inference_ms`` the worker reports for full batches in this phase;
3. for each load level L: Poisson arrivals at L x capacity for --seconds (open loop: the
   arrival times are fixed in advance, and each request is timed from its *scheduled*
   arrival until the client sees its answer), then a drain until every request is answered;
4. capacity again, to show whether the machine's spare CPU changed during the run.

Prints a row per level (p50/p95/p99/max, achieved rate, mean batch size) and, last, p99 at
70% of capacity against the issue 6 target: max wait + 2 x the batch compute time.
Writes bench/out/latency_load.csv and bench/out/latency_load.png (--out-dir: elsewhere).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
from pathlib import Path

from harness import (
    OUT,
    ClosedRun,
    OpenRun,
    RedbatchTarget,
    closed_loop,
    fmt,
    latency_summary,
    machine_load,
    open_loop,
    photos,
    plot,
    reexec_with_worker_malloc,
    set_out_dir,
    start_worker,
    verdict,
    where_time_went,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import DEFAULT_MAX_INFLIGHT

MODEL = "efficientnet_lite0"
TARGET_LEVEL = 0.7


def batch_compute_ms(run: ClosedRun) -> tuple[float, int]:
    """Median inference time of the largest batches seen at saturation, and their size."""
    largest = max(c.finished.batch_size for c in run.steady)
    times = [c.finished.inference_ms for c in run.steady if c.finished.batch_size == largest]
    return statistics.median(times), largest


def measure(url: str, args: argparse.Namespace) -> tuple[ClosedRun, dict[float, OpenRun]]:
    """Warm-up, capacity, then each load level."""
    payloads = photos()
    target = RedbatchTarget(url, MODEL, payloads)
    closed_loop(url, target, args.window, args.warmup_s)
    capacity = closed_loop(url, target, args.window, args.capacity_s)
    print(f"capacity {capacity.throughput:.1f} req/s (window {args.window}, "
          f"{len(capacity.steady)} answers in {args.capacity_s:g} s)", flush=True)
    levels: dict[float, OpenRun] = {}
    for i, level in enumerate(args.levels):
        run = open_loop(url, target, level * capacity.throughput, args.seconds, seed=i)
        levels[level] = run
        lat = latency_summary(run.latencies())
        print(f"  load {level:4.0%}  {run.rate:6.1f} req/s offered  {run.achieved:6.1f} "
              f"answered  n={len(run.completed):4d}  p50 {lat['p50']:7.1f}  p95 "
              f"{lat['p95']:7.1f}  p99 {lat['p99']:7.1f} ms", flush=True)
    # Measured again: when the machine's spare CPU changed, the levels were not what they say.
    args.capacity_after = closed_loop(url, target, args.window, args.capacity_s).throughput
    target.close()
    return capacity, levels


def run(args: argparse.Namespace) -> tuple[ClosedRun, dict[float, OpenRun]]:
    worker_args = [*(["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size
                     else []),
                   *(["--max-wait-ms", str(args.max_wait_ms)] if args.max_wait_ms >= 0
                     else []),
                   *shlex.split(args.worker_args)]
    with RedisServer() as server:
        worker = start_worker(server.url, MODEL, worker_args, "latency_load-worker.log")
        try:
            print(f"worker: {worker.describe()}", flush=True)
            args.max_batch_size = worker.max_batch or args.max_batch_size
            args.max_wait_ms = float(worker.ready.get("max_wait_ms", args.max_wait_ms))
            return measure(server.url, args)
        finally:
            worker.stop()


def mean_batch(run: OpenRun) -> float:
    return statistics.fmean(c.finished.batch_size for c in run.completed)


def report(args: argparse.Namespace, capacity: ClosedRun, levels: dict[float, OpenRun]) -> None:
    compute_ms, compute_size = batch_compute_ms(capacity)
    target_ms = args.max_wait_ms + 2 * compute_ms
    rows = []
    for level, r in levels.items():
        lat = latency_summary(r.latencies())
        rows.append([level, fmt(r.rate, 2), fmt(r.achieved, 2), len(r.completed), r.failed,
                     *(fmt(lat[k]) for k in ("mean", "p50", "p95", "p99", "max")),
                     fmt(mean_batch(r), 2),
                     fmt(statistics.fmean(c.finished.inference_ms for c in r.completed)),
                     fmt(r.max_submit_lag_ms), args.max_batch_size, args.max_wait_ms])
    write_csv("latency_load.csv",
              ["load", "offered_per_s", "answered_per_s", "requests", "failed", "mean_ms",
               "p50_ms", "p95_ms", "p99_ms", "max_ms", "mean_batch_size", "mean_inference_ms",
               "max_submit_lag_ms", "max_batch_size", "max_wait_ms"], rows)
    title = (f"EfficientNet-Lite0, {os.cpu_count()} CPU cores: max batch {args.max_batch_size}, "
             f"max wait {args.max_wait_ms:g} ms, capacity {capacity.throughput:.1f} req/s, "
             f"{args.seconds:g} s per level")
    draw(levels, target_ms, title)

    at = min(levels, key=lambda lv: abs(lv - TARGET_LEVEL))
    p99 = latency_summary(levels[at].latencies())["p99"]
    print(f"cores={os.cpu_count()} max_batch_size={args.max_batch_size} "
          f"max_wait_ms={args.max_wait_ms:g} window={args.window} seconds/level={args.seconds:g} "
          f"worker_args={args.worker_args!r}")
    drift = args.capacity_after / capacity.throughput - 1
    print(f"capacity {capacity.throughput:.1f} req/s before the levels, "
          f"{args.capacity_after:.1f} after ({drift:+.0%})"
          + ("  WARNING: the machine changed under the run; re-run" if abs(drift) > 0.15
             else ""))
    print(f"batch compute time (median of batches of {compute_size} at saturation) "
          f"{compute_ms:.1f} ms")
    print(f"{'load':>5} {'offered':>8} {'answered':>8} {'n':>5} {'p50':>8} {'p95':>8} "
          f"{'p99':>8} {'max':>8} {'batch':>6}   (ms, req/s)")
    for level, r in levels.items():
        lat = latency_summary(r.latencies())
        print(f"{level:5.0%} {r.rate:8.1f} {r.achieved:8.1f} {len(r.completed):5d} "
              f"{lat['p50']:8.1f} {lat['p95']:8.1f} {lat['p99']:8.1f} {lat['max']:8.1f} "
              f"{mean_batch(r):6.2f}")
    parts = where_time_went(levels[at].completed)
    print(f"where the slowest 1% at {at:.0%} spent their time (mean ms): "
          + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in parts.items()))
    formed = statistics.fmean(c.finished.inference_ms for c in levels[at].completed)
    print(f"for reference: at {at:.0%} load batches averaged {mean_batch(levels[at]):.2f} "
          f"requests and {formed:.1f} ms of compute; max wait + 2 x that = "
          f"{args.max_wait_ms + 2 * formed:.1f} ms")
    print(machine_load())
    print(f"wrote {args.out_dir / 'latency_load.csv'}, {args.out_dir / 'latency_load.png'}")
    print(f"RATIO p99 at {at:.0%} load / (max wait + 2 x batch compute) = {p99:.1f} / "
          f"({args.max_wait_ms:g} + 2 x {compute_ms:.1f}) = {p99 / target_ms:.2f}  "
          f"(target <= 1: {verdict(p99, target_ms, higher_is_better=False)})")


def draw(levels: dict[float, OpenRun], target_ms: float, title: str) -> None:
    xs = [lv * 100 for lv in levels]
    summaries = [latency_summary(r.latencies()) for r in levels.values()]

    def figure(plt):  # type: ignore[no-untyped-def]
        fig, ax = plt.subplots(figsize=(9, 5))
        for key, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^-")):
            ax.plot(xs, [s[key] for s in summaries], style, label=key)
        ax.axhline(target_ms, color="red", linestyle="--", linewidth=1,
                   label=f"target at 70%: max wait + 2 x batch = {target_ms:.0f} ms")
        ax.axvline(TARGET_LEVEL * 100, color="gray", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("offered load, % of measured capacity (Poisson arrivals)")
        ax.set_ylabel("latency, ms (client side, from scheduled arrival)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend()

    plot("latency_load.png", figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="arrivals per level")
    parser.add_argument("--levels", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0",
                        help="comma-separated fractions of capacity")
    parser.add_argument("--capacity-s", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--max-batch-size", type=int, default=0,
                        help="pass --max-batch-size to the worker (default: its own choice)")
    parser.add_argument("--max-wait-ms", type=float, default=-1.0,
                        help="pass --max-wait-ms to the worker (default: its own, 5 ms)")
    parser.add_argument("--window", type=int, default=DEFAULT_MAX_INFLIGHT,
                        help="jobs in flight while measuring capacity")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    parser.add_argument("--out-dir", type=Path, default=OUT,
                        help="folder for the CSV, the plot and the worker log "
                             "(default: bench/out)")
    args = parser.parse_args()
    args.out_dir = set_out_dir(args.out_dir)
    args.levels = [float(x) for x in args.levels.split(",")]
    reexec_with_worker_malloc()
    capacity, levels = run(args)
    report(args, capacity, levels)


if __name__ == "__main__":
    main()
