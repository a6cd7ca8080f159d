"""Streamed chat through the HTTP gateway against the Redis reader, same model, same prompts
(issue 32: time to first token through SSE within 5 ms of the Redis reader's).

    .venv/bin/python bench/gateway_stream.py [--requests 16] [--max-tokens 32]

One private redis-server, one generation worker (smollm2_135m), one ``redbatch gateway``.
The requests alternate, one at a time so that neither waits on the other: direct
(``AsyncClient`` submits, then reads the job's token stream with ``chunks``) and through the
gateway (``POST /v1/chat/completions`` with ``stream: true``, events read off a raw
HTTP/1.1 connection). Each is timed from its submit: to the first chunk with text (TTFT)
and to its last. The gateway's CPU (user + system, psutil) is divided by the streamed
events it sent. Prints the figures and the differences last; writes
bench/out/gateway_stream.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import psutil
from harness import machine_load, start_worker, write_csv
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol.generation import CONTENT_TYPE
from redbatch.producer.client import AsyncClient

from gateway import start_gateway

MODEL = "smollm2_135m"
PROMPTS = ["Name three prime numbers.", "What is the capital of France?",
           "Give me a short tip for sleeping well.", "Count from one to ten in words."]


async def direct(client: AsyncClient, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_new_tokens": max_tokens}
    start = time.perf_counter()
    rid = await client.submit(json.dumps(body), content_type=CONTENT_TYPE, model=MODEL,
                              timeout_s=120)
    first, chunks = 0.0, 0
    async for chunk in client.chunks(rid, model=MODEL):
        chunks += 1
        if chunk.text and not first:
            first = time.perf_counter() - start
    return first, time.perf_counter() - start, chunks


async def through(port: int, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    first, events = 0.0, 0
    while line := await reader.readline():
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            events += 1
            choices = json.loads(line[6:])["choices"]
            if not first and choices and choices[0]["delta"].get("content"):
                first = time.perf_counter() - start
    writer.close()
    return first, time.perf_counter() - start, events


async def run(url: str, port: int, gateway_pid: int, n: int, max_tokens: int
              ) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]], float]:
    gw = psutil.Process(gateway_pid)
    rows_direct, rows_gateway, cpu = [], [], 0.0
    async with AsyncClient(url, model=MODEL) as client:
        await direct(client, PROMPTS[0], 4)  # warm both paths
        await through(port, PROMPTS[0], 4)
        for i in range(n):
            prompt = PROMPTS[i % len(PROMPTS)]
            rows_direct.append(await direct(client, prompt, max_tokens))
            before = sum(gw.cpu_times()[:2])
            rows_gateway.append(await through(port, prompt, max_tokens))
            cpu += sum(gw.cpu_times()[:2]) - before
    return rows_direct, rows_gateway, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    with RedisServer() as server:
        worker = start_worker(server.url, MODEL, ["--model", MODEL, "--calibrate", "off"],
                              "gateway_stream_worker.log")
        gateway, port = start_gateway(server.url, MODEL, log_name="gateway_stream.log")
        try:
            d, g, cpu = asyncio.run(run(server.url, port, gateway.pid, args.requests,
                                        args.max_tokens))
        finally:
            gateway.terminate()
            gateway.wait(timeout=20)
            worker.stop()
    med = statistics.median
    ttft_d, ttft_g = med(r[0] for r in d) * 1000, med(r[0] for r in g) * 1000
    end_d, end_g = med(r[1] for r in d) * 1000, med(r[1] for r in g) * 1000
    events = sum(r[2] for r in g)
    write_csv("gateway_stream.csv", ["path", "ttft_p50_ms", "whole_p50_ms", "chunks"],
              [["direct", round(ttft_d, 2), round(end_d, 2), sum(r[2] for r in d)],
               ["gateway", round(ttft_g, 2), round(end_g, 2), events]])
    print(f"machine: {machine_load()}; {args.requests} requests each way, one at a time, "
          f"{args.max_tokens} tokens at most")
    print(f"direct (Redis reader)  TTFT p50 {ttft_d:7.1f} ms   whole answer p50 {end_d:7.1f} ms")
    print(f"through the gateway    TTFT p50 {ttft_g:7.1f} ms   whole answer p50 {end_g:7.1f} ms")
    print(f"gateway CPU per streamed event: {cpu * 1000 / max(events, 1):.2f} ms "
          f"({events} events)")
    print(f"TTFT added by the gateway: {ttft_g - ttft_d:+.1f} ms (target within 5 ms); "
          f"whole answer: {end_g - end_d:+.1f} ms")


if __name__ == "__main__":
    main()
