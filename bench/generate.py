"""Generation through Redis end to end, against the same engine in process.

    .venv/bin/python bench/generate.py [--requests 16] [--rate 2] [--threads 1]
                                       [--stream-interval-ms 20]

One seeded open-loop workload (bench/generate_engine.py's: Poisson arrivals at --rate
requests/s, chat prompts, answer lengths of 8-64 tokens, greedy) is served twice, on the
same model, threads and engine settings (continuous batching, prefix cache on, 32 running):

* **engine only**: ``Engine.step()`` in this process, requests added at their arrival
  times (bench/generate_engine.py's continuous run);
* **through Redis**: a private redis-server and one ``redbatch worker --model
  smollm2_135m`` process; this process submits each chat job at its arrival time
  (``Client.submit``, the admission function) and reads every open token stream with one
  ``XREAD BLOCK`` over all of them, as a gateway would.

Reports for each: answer tokens/s (from the first arrival to the last answer), time to first
token p50/p99 (from the scheduled arrival: an engine that falls behind cannot hide it),
inter-chunk p50/p99 over tokens; for the Redis run, Redis commands per answer token (the
worker's, from INFO commandstats less this process's own calls, and in all) and the
worker's CPU per token. Ratios last: through Redis / engine only (target >= 0.9 in tokens/s).
Writes bench/out/generate.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
import torch
from generate_engine import QUESTIONS, Run, continuous, drive
from harness import pct, start_worker
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import Keys
from redbatch.common.protocol.generation import Chunk
from redbatch.gpu_worker.generation.engine import EngineConfig
from redbatch.gpu_worker.generation.model import Llama, load_weights
from redbatch.gpu_worker.generation.scheduler import SchedulerConfig
from redbatch.handlers import smollm2
from redbatch.producer.client import Client

MODEL = "smollm2_135m"
OUT = Path(__file__).resolve().parent / "out" / "generate.csv"
LENGTHS = (8, 16, 32, 64)
#: This process's own commands (submits, stream reads); the worker's are all the others.
OURS = {"fcall", "fcall_ro", "xread", "function|load", "function", "hello", "client|setinfo",
        "info", "ping", "exists", "get", "del", "flushall", "config|get", "xinfo|groups",
        "hgetall", "smembers", "scan", "mget"}


@dataclass(frozen=True, slots=True)
class Chat:
    id: str
    arrival_s: float
    messages: list[dict[str, str]]
    max_new_tokens: int


def chats(n: int, rate: float, seed: int) -> list[Chat]:
    """The same draws as generate_engine.workload (no shared system prompt)."""
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(Chat(str(i), t, [{"role": "user", "content": rng.choice(QUESTIONS)}],
                        rng.choice(LENGTHS)))
    return out


@dataclass(slots=True)
class RedisRun:
    run: Run
    gaps_ms: list[float] = field(default_factory=list)
    worker_cpu_s: float = 0.0
    worker_calls: int = 0
    all_calls: int = 0
    by_command: Counter[str] = field(default_factory=Counter)
    chunks: int = 0


def commandstats(r: redis.Redis) -> Counter[str]:
    info: Any = r.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()})


def engine_only(model: Llama, work: list[Chat]) -> Run:
    from generate_engine import Job

    jobs = [Job(c.id, c.arrival_s, smollm2.encode(smollm2.chat_prompt(c.messages)),
                c.max_new_tokens) for c in work]
    config = EngineConfig(prefix_cache=True, scheduler=SchedulerConfig(256, 32))
    return drive("engine only", model, jobs, continuous, config)


def through_redis(url: str, work: list[Chat], worker_pid: int) -> RedisRun:
    """Submit at the arrival times on one thread; read every open stream on this one."""
    r = redis.Redis.from_url(url)
    keys = Keys(MODEL)
    out = RedisRun(Run("through Redis"))
    rids: dict[str, Chat] = {}
    submitted = threading.Event()
    start = time.perf_counter()

    def submit() -> None:
        with Client(url, model=MODEL) as client:
            for chat in work:
                time.sleep(max(0.0, chat.arrival_s - (time.perf_counter() - start)))
                body = {"messages": chat.messages, "max_new_tokens": chat.max_new_tokens}
                rid = client.submit(json.dumps(body).encode(), content_type="application/json")
                rids[str(rid)] = chat
        submitted.set()

    proc = psutil.Process(worker_pid)
    cpu0, calls0 = sum(proc.cpu_times()[:2]), commandstats(r)
    sender = threading.Thread(target=submit, daemon=True)
    sender.start()
    last: dict[str, str] = {}
    seen_at: dict[str, float] = {}
    done = 0
    reads = 0
    while done < len(work):
        open_streams = {keys.tokens(rid): last.get(rid, "0-0") for rid in list(rids)
                        if last.get(rid) != "end"}
        if not open_streams:
            time.sleep(0.005)
            continue
        reply: Any = r.xread(open_streams, block=1000)  # type: ignore[arg-type]
        reads += 1
        now = time.perf_counter() - start
        for key, entries in reply or []:
            rid = key.decode().rsplit(":", 1)[1]
            for entry_id, fields in entries:
                chunk = Chunk.read(entry_id, fields)
                out.chunks += 1
                out.run.tokens += len(chunk.token_ids)
                chat = rids[rid]
                if rid not in seen_at and chunk.token_ids:
                    out.run.ttft_s.append(now - chat.arrival_s)
                elif rid in seen_at and chunk.token_ids:
                    out.gaps_ms.append((now - seen_at[rid]) * 1000 / len(chunk.token_ids))
                if chunk.token_ids:
                    seen_at[rid] = now
                last[rid] = entry_id.decode()
                if chunk.finish is not None:
                    last[rid] = "end"
                    done += 1
    out.run.span_s = time.perf_counter() - start - work[0].arrival_s
    sender.join()
    out.worker_cpu_s = sum(proc.cpu_times()[:2]) - cpu0
    time.sleep(0.3)  # the last results' transactions
    delta = commandstats(r) - calls0
    out.by_command = delta
    out.all_calls = sum(delta.values())
    out.worker_calls = sum(n for c, n in delta.items() if c not in OURS)
    r.close()
    return out


def report_line(name: str, run: Run, gaps: list[float]) -> None:
    print(f"{name:<14} {run.tokens:>6} tokens  {run.tokens_per_s:7.1f} tokens/s  "
          f"TTFT p50 {run.ttft(0.5):7.0f} ms  p99 {run.ttft(0.99):7.0f} ms"
          + (f"  per token p50 {pct(gaps, 50):5.0f} ms  p99 {pct(gaps, 99):5.0f} ms"
             if gaps else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--stream-interval-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = chats(args.requests, args.rate, args.seed)
    model = Llama(load_weights())
    smollm2.tokenizer()
    print(f"{args.requests} requests at {args.rate}/s, answers of {LENGTHS} tokens, "
          f"{args.threads} torch thread(s), stream interval {args.stream_interval_ms:g} ms")
    alone = engine_only(model, work)
    del model
    with RedisServer() as server:
        worker = start_worker(server.url, MODEL, [
            "--model", MODEL, "--torch-threads", str(args.threads), "--calibrate", "off",
            "--stream-interval-ms", str(args.stream_interval_ms)], "generate-worker.log")
        try:
            served = through_redis(server.url, work, worker.pid)
        finally:
            worker.stop()
    report_line("engine only", alone, [])
    report_line("through Redis", served.run, served.gaps_ms)
    tokens = max(1, served.run.tokens)
    top = ", ".join(f"{c} {n}" for c, n in served.by_command.most_common(8))
    print(f"Redis commands: {served.all_calls} in all ({top}); the worker's "
          f"{served.worker_calls}: {served.worker_calls / tokens:.2f} a token; "
          f"{served.chunks} chunks ({tokens / max(1, served.chunks):.1f} tokens a chunk)")
    print(f"worker CPU {served.worker_cpu_s / tokens * 1000:.0f} ms a token; engine only "
          f"{alone.cpu_s / max(1, alone.tokens) * 1000:.0f} ms a token (this process)")
    write_csv(alone, served)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}" + ("  (busy machine: rerun on a quiet one)"
                                        if load > 1.5 else ""))
    ratio = served.run.tokens_per_s / alone.tokens_per_s if alone.tokens_per_s else 0.0
    ttft = served.run.ttft(0.5) / alone.ttft(0.5) if alone.ttft_s else 0.0
    print(f"RATIO through Redis / engine only: tokens/s {ratio:.2f} (target >= 0.9: "
          f"{'MET' if ratio >= 0.9 else 'MISSED'}); TTFT p50 {ttft:.2f}x")


def write_csv(alone: Run, served: RedisRun) -> None:
    OUT.parent.mkdir(exist_ok=True)
    with OUT.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
                    "worker_redis_calls_per_token", "worker_cpu_ms_per_token"])
        w.writerow([alone.name, alone.tokens, round(alone.tokens_per_s, 2),
                    round(alone.ttft(0.5)), round(alone.ttft(0.99)), "", ""])
        tokens = max(1, served.run.tokens)
        w.writerow([served.run.name, served.run.tokens, round(served.run.tokens_per_s, 2),
                    round(served.run.ttft(0.5)), round(served.run.ttft(0.99)),
                    round(served.worker_calls / tokens, 3),
                    round(served.worker_cpu_s / tokens * 1000, 1)])


if __name__ == "__main__":
    main()
