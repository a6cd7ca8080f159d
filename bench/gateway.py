"""The HTTP gateway against the Python client, same model, same load (issue 32).

    .venv/bin/python bench/gateway.py [--model null_tensor] [--concurrency 32] [--seconds 8]

One private redis-server, one worker, one ``redbatch gateway`` process. Two phases, each
run direct (``AsyncClient.predict``) and through the gateway (``POST
/v1/models/M/jobs?wait=S``, raw HTTP/1.1 keep-alive from asyncio streams, so the driver's
own cost stays small):

1. closed loop, ``--concurrency`` requests in flight: throughput, and the gateway's CPU
   (user + system, psutil) per request;
2. open loop at ``--load`` (80%) of the lower closed-loop throughput of the two, Poisson
   arrivals, each request timed from its scheduled arrival: p50/p99, and p99 added.

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


def start_gateway(url: str, model: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "redbatch.cli", "gateway", "--redis", url,
                                 "--port", str(port), "--model", model, "--log-level",
                                 "WARNING"], stdout=log, stderr=subprocess.STDOUT)
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


async def run(args: argparse.Namespace, url: str, port: int, gw: psutil.Process) -> list[list[str]]:
    client = AsyncClient(url, model=args.model)
    # The gateway's pool (GatewaySettings.redis_connections), so neither path refuses a call
    # past redis-py's default of 100 connections.
    client.redis.connection_pool.max_connections = 2000
    pool = HttpPool(port, args.model)

    async def direct() -> None:
        (await client.predict(PAYLOAD, timeout_s=30)).raise_for_error()

    for call in (direct, pool.call):  # warm both paths
        await closed(call, args.concurrency, 1.0)
    d = await closed(direct, args.concurrency, args.seconds)
    print(f"closed, direct: {d.rate:.0f}/s", flush=True)
    before = cpu_s(gw)
    g = await closed(pool.call, args.concurrency, args.seconds)
    cpu_ms = (cpu_s(gw) - before) * 1000 / g.done
    print(f"closed, gateway: {g.rate:.0f}/s", flush=True)
    rate = args.load * min(d.rate, g.rate)  # both paths below their capacity
    od = await open_loop(direct, rate, args.seconds, 1)
    print(f"open {rate:.0f}/s, direct: p99 {pct(od.latencies_ms, 99):.1f} ms", flush=True)
    og = await open_loop(pool.call, rate, args.seconds, 1)
    await client.close()
    rows = [["phase", "path", "requests", "per_s", "p50_ms", "p99_ms", "gateway_cpu_ms"]]
    for phase, path, p, cpu in (("closed", "direct", d, ""), ("closed", "gateway", g, cpu_ms),
                                (f"open {rate:.0f}/s", "direct", od, ""),
                                (f"open {rate:.0f}/s", "gateway", og, "")):
        rows.append([phase, path, str(p.done), f"{p.rate:.1f}", f"{pct(p.latencies_ms, 50):.2f}",
                     f"{pct(p.latencies_ms, 99):.2f}",
                     f"{cpu:.3f}" if isinstance(cpu, float) else ""])
    for row in rows:
        print("  ".join(f"{c:>16}" for c in row))
    print(f"\nload: {machine_load()}")
    print(f"gateway CPU per request: {cpu_ms:.3f} ms (target <= 1)")
    print(f"throughput, gateway / direct (closed, {args.concurrency} in flight): "
          f"{g.rate / d.rate:.2f}x (target >= 0.9)")
    print(f"p99 added at {args.load:.0%} of the gateway's capacity ({rate:.0f}/s): "
          f"{pct(og.latencies_ms, 99) - pct(od.latencies_ms, 99):+.2f} ms (target <= 5)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="null_tensor")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--load", type=float, default=0.8)
    args = ap.parse_args()
    with RedisServer() as server:
        worker = start_worker(server.url, args.model,
                              ["--model", args.model, "--calibrate", "off"], "gateway-worker.log")
        gateway, port = start_gateway(server.url, args.model)
        try:
            rows = asyncio.run(run(args, server.url, port, psutil.Process(gateway.pid)))
            print(f"wrote {write_csv('gateway.csv', rows[0], rows[1:])}")
        finally:
            gateway.terminate()
            gateway.wait(timeout=20)
            worker.stop()


if __name__ == "__main__":
    main()
