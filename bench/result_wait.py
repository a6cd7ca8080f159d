"""What waiting for a replica costs: null-model jobs/s and latency with --result-replicas 0 / 1.

    .venv/bin/python bench/result_wait.py [--seconds 8] [--window 64] [--batch 32]
                                          [--repeat 3] [--wait-ms 100] [--model null_tensor]

One master and one replica (``redis-server --replicaof``) on loopback, started here. Each
run starts a ``redbatch worker --model null_tensor --calibrate off`` with
``--result-replicas 0`` (no WAIT) or ``1`` (one ``WAIT 1 --wait-ms`` after each write of
results), and drives it with the closed loop of bench/harness.py (``--window`` jobs in
flight, a new one submitted as each finishes) for ``--seconds`` after a warm-up. Runs
alternate, 0, 1, 0, 1, ..., ``--repeat`` of each, so a change in the shared machine's load
falls on both; each setting's median run is reported, then each round's ratios (its run
with the wait over the run without it just before) and, last, their medians.
The worker's log is searched for its short-wait warning (a WAIT that timed out).

Writes bench/out/result_wait-wWINDOW.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import redis
from harness import (
    OUT,
    ClosedRun,
    RedbatchTarget,
    closed_loop,
    fmt,
    latency_summary,
    machine_load,
    payloads_for,
    start_worker,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer


def start_pair() -> tuple[RedisServer, RedisServer]:
    """A master and its replica, in sync."""
    master = RedisServer().start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)]).start()
    r = redis.Redis(port=master.port, socket_timeout=2)
    deadline = time.monotonic() + 30
    while r.info("replication").get("slave0", {}).get("state") != "online":
        if time.monotonic() > deadline:
            raise TimeoutError("the replica did not come online in 30 s")
        time.sleep(0.05)
    r.close()
    return master, replica


def one_run(url: str, replicas: int, args: argparse.Namespace) -> tuple[ClosedRun, int]:
    """A closed loop through a fresh worker; also how many short-wait warnings it logged."""
    log_name = f"result-wait-{replicas}.log"
    worker = start_worker(url, args.model, [
        "--model", args.model, "--calibrate", "off", "--max-batch-size", str(args.batch),
        "--max-inflight", str(max(args.window, args.batch)),
        "--result-replicas", str(replicas), "--result-wait-ms", str(args.wait_ms)], log_name)
    try:
        target = RedbatchTarget(url, args.model, payloads_for(args.model))
        run = closed_loop(url, target, args.window, args.seconds, warmup_s=args.warmup_s)
        target.close()
    finally:
        worker.stop()
    short = (OUT / log_name).read_text(errors="replace").count("a failover now could lose")
    return run, short


def median_run(runs: list[ClosedRun]) -> ClosedRun:
    return sorted(runs, key=lambda run: run.throughput)[len(runs) // 2]


def report(args: argparse.Namespace, runs: dict[int, list[ClosedRun]],
           short: dict[int, int]) -> None:
    rows, shown = [], {}
    for replicas, each in runs.items():
        for i, run in enumerate(each):
            lat = latency_summary(run.latencies())
            rows.append([replicas, i + 1, len(run.steady), fmt(run.throughput),
                         fmt(lat["p50"], 2), fmt(lat["p99"], 2), run.failed])
        med = median_run(each)
        shown[replicas] = (med.throughput, latency_summary(med.latencies()))
    path = write_csv(f"result_wait-w{args.window}.csv", [
        "result_replicas", "run", "jobs", "jobs_per_s", "p50_ms", "p99_ms", "failed"], rows)
    print(f"cores={os.cpu_count()} model={args.model} window={args.window} "
          f"batch={args.batch} seconds={args.seconds} repeat={args.repeat} "
          f"wait_ms={args.wait_ms}")
    for replicas, each in runs.items():
        rates = ", ".join(f"{run.throughput:.0f}" for run in each)
        rate, lat = shown[replicas]
        print(f"--result-replicas {replicas}: median {rate:.0f} jobs/s (runs: {rates}); "
              f"p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms; short-wait warnings "
              f"{short[replicas]}; failed {sum(run.failed for run in each)}")
    print(machine_load())
    print(f"wrote {path}")
    paired = paired_ratios(runs)
    print("ratios 1 / 0 of each round (its two runs back to back): " + "; ".join(
        f"{r['jobs/s']:.2f} {r['p50']:.2f} {r['p99']:.2f}" for r in paired)
        + "  (jobs/s, p50, p99)")
    median = {k: statistics.median(r[k] for r in paired) for k in ("jobs/s", "p50", "p99")}
    print(f"RATIO --result-replicas 1 / 0, median of {len(paired)} rounds: jobs/s "
          f"{median['jobs/s']:.2f}, p50 {median['p50']:.2f}, p99 {median['p99']:.2f}")


def paired_ratios(runs: dict[int, list[ClosedRun]]) -> list[dict[str, float]]:
    """Each round's run with the wait over the run without it just before: a change in the
    shared machine's load between rounds falls on neither ratio."""
    out = []
    for without, with_wait in zip(runs[0], runs[1], strict=True):
        lat0, lat1 = latency_summary(without.latencies()), latency_summary(with_wait.latencies())
        out.append({"jobs/s": with_wait.throughput / without.throughput,
                    "p50": lat1["p50"] / lat0["p50"], "p99": lat1["p99"] / lat0["p99"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="steady phase of each run")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window", type=int, default=64, help="jobs in flight")
    parser.add_argument("--batch", type=int, default=32, help="largest batch")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each setting")
    parser.add_argument("--wait-ms", type=int, default=100, help="--result-wait-ms")
    parser.add_argument("--model", default="null_tensor", choices=["null_tensor", "null"])
    args = parser.parse_args()
    runs: dict[int, list[ClosedRun]] = {0: [], 1: []}
    short = {0: 0, 1: 0}
    master, replica = start_pair()
    try:
        for _ in range(max(1, args.repeat)):
            for replicas in (0, 1):
                run, warned = one_run(master.url, replicas, args)
                runs[replicas].append(run)
                short[replicas] += warned
    finally:
        replica.stop()
        master.stop()
    report(args, runs, short)


if __name__ == "__main__":
    main()
