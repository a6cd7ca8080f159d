"""The HTTP gateway against the Python client, same model, same load (issue 32).

    .venv/bin/python bench/gateway.py [--model null_tensor] [--concurrency 32] [--seconds 8]
        [--rate R] [--before-in-flight N]

One private redis-server, one worker, one ``redbatch gateway`` process. Two phases, each
run direct (``AsyncClient.predict``) and through the gateway (``POST
/v1/models/M/jobs?wait=S``, raw HTTP/1.1 keep-alive from asyncio streams, so the driver's
own cost stays small):

1. closed loop, ``--concurrency`` requests in flight: throughput, and the gateway's CPU
   (user + system, psutil) per request;
2. open loop at ``--load`` (80%) of the lower closed-loop throughput of the two, Poisson
   arrivals, each request timed from its scheduled arrival: p50/p99, and p99 added.

``--rate`` fixes the open loop's rate (else ``--load`` of the lower closed-loop rate).
``--before-in-flight N`` runs a second gateway with ``--submit-calls-in-flight N`` (a large N
is the coalescer of before group commit: one call per event-loop turn) through the same
phases, so before and after are measured in one run.

Prints the ratios last and writes bench/out/gateway.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psutil
from harness import OUT, machine_load, pct, start_worker, write_csv
from redbatch.cli.redis_server import RedisServer, free_port
from redbatch.producer.client import AsyncClient, RedbatchError

PAYLOAD = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
Call = Callable[[], Awaitable[None]]


class HttpPool:
    """Keep-alive HTTP/1.1 connections to the gateway; one request per connection at once."""

    def __init__(self, port: int, model: str) -> None:
        self.port = port
        self.free: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.request = (f"POST /v1/models/{model}/jobs?wait=30&timeout=30 HTTP/1.1\r\n"
                        f"Host: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                        f"Content-Length: {len(PAYLOAD)}\r\n\r\n").encode() + PAYLOAD

    async def call(self) -> None:
        conn = self.free.pop() if self.free else await asyncio.open_connection(
            "127.0.0.1", self.port)
        reader, writer = conn
        writer.write(self.request)
        status = await reader.readline()
        if not status:  # the server closed an idle keep-alive connection: a new one
            writer.close()
            reader, writer = conn = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(self.request)
            status = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        if b" 200 " not in status:
            raise RuntimeError(f"gateway answered {status!r}: {body[:300]!r}")
        self.free.append(conn)


@dataclass
class Phase:
    done: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.done / self.seconds


async def closed(call: Call, concurrency: int, seconds: float) -> Phase:
    stop = time.perf_counter() + seconds
    lat: list[float] = []

    async def loop() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await call()
            lat.append((time.perf_counter() - t) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return Phase(len(lat), time.perf_counter() - start, lat)


async def open_loop(call: Call, rate: float, seconds: float, seed: int) -> Phase:
    rng = random.Random(seed)
    lat: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    at, tasks = 0.0, []

    async def one(scheduled: float) -> None:
        try:
            await call()
        except (RuntimeError, RedbatchError) as e:  # an error answer: counted, not timed
            errors.append(str(e)[:200])
            return
        lat.append((time.perf_counter() - scheduled) * 1000)

    while at < seconds:
        at += rng.expovariate(rate)
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(start + at)))
    await asyncio.gather(*tasks)
    if errors:
        print(f"  {len(errors)} of {len(tasks)} answered with an error, e.g. {errors[0]}")
    return Phase(len(lat), time.perf_counter() - start, lat)


def start_gateway(url: str, model: str, in_flight: int | None = None,
                  log_name: str = "gateway.log") -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    OUT.mkdir(parents=True, exist_ok=True)
    extra = ["--submit-calls-in-flight", str(in_flight)] if in_flight else []
    with open(OUT / log_name, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "redbatch.cli", "gateway", "--redis", url,
                                 "--port", str(port), "--model", model, "--log-level",
                                 "WARNING", *extra], stdout=log, stderr=subprocess.STDOUT)
    import urllib.request
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the gateway did not start: bench/out/gateway.log") from None
            time.sleep(0.1)


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def run(args: argparse.Namespace, url: str,
              gateways: list[tuple[str, int, psutil.Process]]) -> list[list[str]]:
    """Long because it is the bench's script: the phases in order, then the table."""
    client = AsyncClient(url, model=args.model)
    # The gateway's pool (GatewaySettings.redis_connections), so neither path refuses a call
    # past redis-py's default of 100 connections.
    client.redis.connection_pool.max_connections = 2000
    pools = [(name, HttpPool(port, args.model), proc) for name, port, proc in gateways]

    async def direct() -> None:
        (await client.predict(PAYLOAD, timeout_s=30)).raise_for_error()

    for call in (direct, *(p.call for _, p, _ in pools)):  # warm every path
        await closed(call, args.concurrency, 1.0)
    d = await closed(direct, args.concurrency, args.seconds)
    print(f"closed, direct: {d.rate:.0f}/s", flush=True)
    shut: dict[str, tuple[Phase, float]] = {}
    for name, pool, proc in pools:
        before = cpu_s(proc)
        g = await closed(pool.call, args.concurrency, args.seconds)
        shut[name] = (g, (cpu_s(proc) - before) * 1000 / g.done)
        print(f"closed, {name}: {g.rate:.0f}/s", flush=True)
    rate = args.rate or args.load * min([d.rate, *(g.rate for g, _ in shut.values())])
    od = await open_loop(direct, rate, args.seconds, 1)
    print(f"open {rate:.0f}/s, direct: p99 {pct(od.latencies_ms, 99):.1f} ms", flush=True)
    opened: dict[str, tuple[Phase, float]] = {}
    for name, pool, proc in pools:
        before = cpu_s(proc)
        og = await open_loop(pool.call, rate, args.seconds, 1)
        opened[name] = (og, (cpu_s(proc) - before) * 1000 / max(og.done, 1))
        print(f"open {rate:.0f}/s, {name}: p99 {pct(og.latencies_ms, 99):.1f} ms", flush=True)
    await client.close()
    rows = [["phase", "path", "requests", "per_s", "p50_ms", "p99_ms", "gateway_cpu_ms"]]
    table: list[tuple[str, str, Phase, float | None]] = [("closed", "direct", d, None)]
    table += [("closed", n, g, c) for n, (g, c) in shut.items()]
    table += [(f"open {rate:.0f}/s", "direct", od, None)]
    table += [(f"open {rate:.0f}/s", n, g, c) for n, (g, c) in opened.items()]
    for phase, path, p, cpu in table:
        rows.append([phase, path, str(p.done), f"{p.rate:.1f}", f"{pct(p.latencies_ms, 50):.2f}",
                     f"{pct(p.latencies_ms, 99):.2f}", "" if cpu is None else f"{cpu:.3f}"])
    for row in rows:
        print("  ".join(f"{c:>16}" for c in row))
    print(f"\nload: {machine_load()}")
    for name in shut:
        (g, cpu_ms), (og, open_cpu) = shut[name], opened[name]
        print(f"{name}: CPU a request {cpu_ms:.3f} ms closed, {open_cpu:.3f} ms open "
              f"(target <= 1); throughput / direct (closed, {args.concurrency} in flight) "
              f"{g.rate / d.rate:.2f}x (target >= 0.9); p99 added at {rate:.0f}/s "
              f"{pct(og.latencies_ms, 99) - pct(od.latencies_ms, 99):+.2f} ms (target <= 5)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="null_tensor")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--rate", type=float, default=0.0,
                    help="the open loop's requests/s (default: --load of the closed rates)")
    ap.add_argument("--before-in-flight", type=int, default=0,
                    help="also a gateway with --submit-calls-in-flight N (the before)")
    args = ap.parse_args()
    with RedisServer() as server:
        worker = start_worker(server.url, args.model,
                              ["--model", args.model, "--calibrate", "off"], "gateway-worker.log")
        started = [("gateway", *start_gateway(server.url, args.model))]
        if args.before_in_flight:
            started.append((f"gateway, {args.before_in_flight} in flight",
                            *start_gateway(server.url, args.model, args.before_in_flight,
                                           "gateway-before.log")))
        try:
            rows = asyncio.run(run(args, server.url, [(n, port, psutil.Process(p.pid))
                                                      for n, p, port in started]))
            print(f"wrote {write_csv('gateway.csv', rows[0], rows[1:])}")
        finally:
            for _, proc, _ in started:
                proc.terminate()
                proc.wait(timeout=20)
            worker.stop()


if __name__ == "__main__":
    main()
