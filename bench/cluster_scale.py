"""Scale curve: null-model workers against one Redis and against a 3-master Redis Cluster.

    .venv/bin/python bench/cluster_scale.py [--workers 1,2,4,8] [--partitions 3,6,12]
                                            [--seconds 10] [--clients 4] [--batch 128]

For one Redis (P = 1) and for a local cluster (3 masters + 3 replicas, tests/cluster.py)
with each partition count P, and for each worker count N: start N `redbatch worker --model
null_tensor` processes (no decoding, no pool: Redis and redbatch's own work only), keep
--clients client threads each submitting --batch jobs and waiting for them, over and over,
for --seconds; count the jobs answered, and read each Redis node's CPU time (user + system,
from the OS) and commands processed (INFO stats) over the same seconds.

Prints one row per (backend, N): jobs/s, the busiest master's CPU share of one core,
Redis commands per job, and the CPU the clients (this process) and the workers spent a job;
then the per-node ceiling each backend implies (jobs/s at which its
busiest node would be at 100% of a core, from the measured commands and CPU per job) and
how many masters a fleet rate needs at that ceiling (--fleet-rate, jobs/s).

On 2 cores the client, the workers and six Redis nodes share the machine, so absolute
figures are small and the machine saturates before Redis does: the shape (jobs/s against
N, per backend) and the per-node command and CPU cost per job are the point. A measurement,
not a test; writes bench/out/cluster_scale.csv.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis
from harness import ROOT, machine_load, start_worker, tensors, write_csv
from redbatch.cli.redis_server import RedisServer
from redbatch.producer.client import Client

sys.path.insert(0, str(ROOT / "tests"))
from cluster import LocalCluster  # noqa: E402  (the tests' local cluster, reused)

MODEL = "null_tensor"


@dataclass
class Row:
    backend: str
    workers: int
    jobs_per_s: float
    busiest_cpu: float  # share of one core, the busiest master
    commands_per_job: float  # over all masters
    client_ms: float = 0.0  # CPU ms a job: this process (the clients)
    workers_ms: float = 0.0  # CPU ms a job: the workers, together


def node_usage(servers: list[RedisServer]) -> dict[int, tuple[float, int]]:
    """CPU seconds and commands processed so far, per server port."""
    out = {}
    for s in servers:
        assert s.pid is not None
        times = psutil.Process(s.pid).cpu_times()
        info = redis.Redis(port=s.port).info("stats")
        out[s.port] = (times.user + times.system, int(info["total_commands_processed"]))
    return out


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes used so far, together."""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def drive(url: str, clients: int, batch: int, seconds: float) -> int:
    """Jobs answered in ``seconds`` by ``clients`` threads, each submitting ``batch`` jobs
    and waiting for them, again and again."""
    payloads = tensors(batch)
    done = [0] * clients
    stop_at = time.monotonic() + seconds

    def loop(i: int) -> None:
        with Client(url, model=MODEL) as client:
            while time.monotonic() < stop_at:
                jobs = client.submit_many(payloads, timeout_s=60)
                client.results(jobs, timeout_s=120)
                done[i] += len(jobs) if time.monotonic() <= stop_at else 0

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done)


def measure(backend: str, url: str, masters: list[RedisServer], n: int,
            args: argparse.Namespace) -> Row:
    workers = [start_worker(url, MODEL, ["--model", MODEL, "--calibrate", "off",
                                         "--max-batch-size", "64", "--max-inflight", "256"],
                            f"cluster_scale-{backend}-{n}-{i}.log") for i in range(n)]
    pids = [w.pid for w in workers]
    try:
        drive(url, args.clients, args.batch, 2.0)  # warm-up, not counted
        before, t0 = node_usage(masters), time.monotonic()
        mine, theirs = process_cpu_s([os.getpid()]), process_cpu_s(pids)
        jobs = drive(url, args.clients, args.batch, args.seconds)
        after, elapsed = node_usage(masters), time.monotonic() - t0
        mine, theirs = process_cpu_s([os.getpid()]) - mine, process_cpu_s(pids) - theirs
    finally:
        for w in workers:
            w.stop()
    cpu = {p: (after[p][0] - before[p][0]) / elapsed for p in after}
    commands = sum(after[p][1] - before[p][1] for p in after)
    done = max(jobs, 1)
    row = Row(backend, n, jobs / elapsed, max(cpu.values()), commands / done,
              1000 * mine / done, 1000 * theirs / done)
    print(f"  {backend:14s} workers {n}: {row.jobs_per_s:7.0f} jobs/s   busiest master "
          f"{row.busiest_cpu:5.0%} of a core   {row.commands_per_job:5.2f} commands/job   "
          f"CPU ms a job: clients {row.client_ms:.3f}, workers {row.workers_ms:.3f} "
          f"(per master: {', '.join(f'{c:.0%}' for c in cpu.values())})", flush=True)
    return row


def set_partitions(url: str, count: int) -> None:
    subprocess.run([sys.executable, "-m", "redbatch.cli", "partitions", "--model", MODEL,
                    "--set", str(count), "--redis", url], check=True, capture_output=True)


def run(args: argparse.Namespace) -> list[Row]:
    rows = []
    with RedisServer() as single:
        print("one Redis (P = 1)", flush=True)
        rows += [measure("redis", single.url, [single], n, args) for n in args.workers]
    for count in args.partitions:
        with LocalCluster() as cluster:  # started: 3 masters, 3 replicas
            masters = [node for node in cluster.nodes
                       if redis.Redis(port=node.port).info("replication")["role"] == "master"]
            set_partitions(cluster.url, count)
            print(f"cluster, 3 masters, P = {count}", flush=True)
            rows += [measure(f"cluster-P{count}", cluster.url, masters, n, args)
                     for n in args.workers]
    return rows


def report(rows: list[Row], fleet_rate: float) -> None:
    write_csv("cluster_scale.csv", ["backend", "workers", "jobs_per_s", "busiest_master_cpu",
                                    "commands_per_job", "client_cpu_ms_per_job",
                                    "workers_cpu_ms_per_job"],
              [[r.backend, r.workers, round(r.jobs_per_s, 1), round(r.busiest_cpu, 3),
                round(r.commands_per_job, 2), round(r.client_ms, 4), round(r.workers_ms, 4)]
               for r in rows])
    for backend in dict.fromkeys(r.backend for r in rows):
        mine = [r for r in rows if r.backend == backend]
        top = max(mine, key=lambda r: r.jobs_per_s)
        masters = 1 if backend == "redis" else 3
        # The whole backend saturates when its busiest master does; a master's share of
        # that, with partitions spread evenly, is the per-node ceiling.
        whole = top.jobs_per_s / top.busiest_cpu if top.busiest_cpu else math.nan
        per_node = whole / masters
        curve = ", ".join(f"{r.workers}: {r.jobs_per_s:.0f}" for r in mine)
        print(f"{backend:14s} jobs/s by workers {{{curve}}}; busiest master at one core: "
              f"{whole:.0f} jobs/s in all, {per_node:.0f} a master; {fleet_rate:.0f} "
              f"jobs/s needs {math.ceil(fleet_rate / per_node)} master(s) at that rate")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--partitions", default="3,6,12")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--fleet-rate", type=float, default=100_000.0)
    args = p.parse_args()
    args.workers = [int(x) for x in args.workers.split(",")]
    args.partitions = [int(x) for x in args.partitions.split(",")]
    print(f"{machine_load()}", flush=True)
    report(run(args), args.fleet_rate)
    print(f"wrote {Path('bench/out/cluster_scale.csv')}")


if __name__ == "__main__":
    main()
