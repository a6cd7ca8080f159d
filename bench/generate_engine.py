"""The generation engine in process: continuous batching against static batches and
one-at-a-time serving, and the prefix cache on a shared system prompt.

    .venv/bin/python bench/generate_engine.py [--requests 16] [--rate 2] [--threads 1]

One seeded open-loop workload (Poisson arrivals at --rate requests/s, chat prompts, answer
lengths drawn from LENGTHS, greedy) goes through the engine (gpu_worker/generation/) on the
smollm2_135m model, driven four ways on the same clock:

* one-at-a-time: a running batch of one, the next request when it ends;
* static batches: up to --static-batch arrived requests start together and run to the
  end of the longest; nothing joins a running batch;
* continuous: requests join and leave the running batch at every step (chunked prefill,
  decodes first), prefix cache off;
* and on a second workload whose requests share a long system prompt, continuous batching
  without and with the prefix cache;
* and, where transformers is installed (the ``reference`` extra), both workloads through
  transformers' own continuous batching on the same file and threads, the peer
  (bench/transformers_peer.py), whose prefix sharing is on by default.

Reports tokens/s (answer tokens over the span from the first arrival to the last answer),
time to first token p50/p99 (from each request's arrival), steps, and the process's CPU
time per answer token (the figure that holds on a busy machine, where wall time does not);
the ratios last, the CPU ones too. Writes bench/out/generate_engine.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers_peer
from redbatch.gpu_worker.generation.engine import Engine, EngineConfig
from redbatch.gpu_worker.generation.model import Llama, load_weights
from redbatch.gpu_worker.generation.sampling import SamplingParams
from redbatch.gpu_worker.generation.scheduler import SchedulerConfig
from redbatch.handlers import smollm2

OUT = Path(__file__).resolve().parent / "out" / "generate_engine.csv"

LENGTHS = (8, 16, 32, 64)
QUESTIONS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Count from 1 to 10.",
    "Explain gravity to a child.", "Give me a recipe for pancakes.", "Who wrote Hamlet?",
    "What does HTTP stand for?", "List three prime numbers.", "Tell me a joke.",
    "How do plants make food?", "Describe a sunset.", "What is a black hole?",
)
SHARED_SYSTEM = (
    "You are the support assistant of Northwind Traders, a company that sells tea, coffee "
    "and spices online. Answer politely and briefly. Orders ship within two working days; "
    "returns are accepted within thirty days with the receipt; loyalty members get free "
    "shipping over twenty pounds. Never promise a refund before the item is back. If a "
    "question is about something else, say that you can only help with Northwind orders, "
    "products, shipping and returns, and suggest the customer writes to the help desk.")


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    arrival_s: float
    prompt: list[int]
    max_new_tokens: int


@dataclass(slots=True)
class Run:
    name: str
    tokens: int = 0
    span_s: float = 0.0
    steps: int = 0
    cpu_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.span_s if self.span_s else 0.0

    def ttft(self, q: float) -> float:
        values = sorted(self.ttft_s)
        return values[min(len(values) - 1, int(q * len(values)))] * 1000


def workload(n: int, rate: float, seed: int, system: str | None) -> list[Job]:
    rng, t, jobs = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": rng.choice(QUESTIONS)}]
        jobs.append(Job(str(i), t, smollm2.encode(smollm2.chat_prompt(chat)),
                        rng.choice(LENGTHS)))
    return jobs


Admit = Callable[[Engine, list[Job], float], list[Job]]


def continuous(engine: Engine, arrived: list[Job], now: float) -> list[Job]:
    return arrived   # everything that has arrived joins at the next step


def one_at_a_time(engine: Engine, arrived: list[Job], now: float) -> list[Job]:
    return arrived[:1] if not engine.has_work() else []


def static(size: int) -> Admit:
    def admit(engine: Engine, arrived: list[Job], now: float) -> list[Job]:
        return arrived[:size] if not engine.has_work() else []
    return admit


def drive(name: str, model: Llama, jobs: list[Job], admit: Admit,
          config: EngineConfig) -> Run:
    """Replay the arrivals on the wall clock; the engine steps whenever it has work."""
    engine, run = Engine(model, smollm2.decode, config), Run(name)
    pending, arrived, first = list(jobs), [], {}
    start, cpu = time.perf_counter(), time.process_time()
    by_id = {job.id: job for job in jobs}
    done = 0
    while done < len(jobs):
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            arrived.append(pending.pop(0))
        for job in admit(engine, arrived, now):
            arrived.remove(job)
            engine.add(job.id, job.prompt, SamplingParams(max_new_tokens=job.max_new_tokens))
        if not engine.has_work():
            if pending:
                time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        outputs = engine.step()
        run.steps += 1
        at = time.perf_counter() - start
        for out in outputs:
            run.tokens += len(out.token_ids)
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = at
                run.ttft_s.append(at - by_id[out.request_id].arrival_s)
            done += out.finish is not None
    run.span_s = time.perf_counter() - start - jobs[0].arrival_s
    run.cpu_s = time.process_time() - cpu
    return run


def report(run: Run) -> None:
    print(f"{run.name:<28} {run.tokens:>6} tokens  {run.tokens_per_s:7.1f} tokens/s  "
          f"TTFT p50 {run.ttft(0.5):7.0f} ms  p99 {run.ttft(0.99):7.0f} ms  "
          f"{run.steps:>5} steps  {run.span_s:6.1f} s  {run.cpu_s / run.tokens * 1000:6.0f} "
          "CPU ms/token")


def write_csv(runs: list[Run]) -> None:
    OUT.parent.mkdir(exist_ok=True)
    with OUT.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "steps",
                    "span_s", "cpu_ms_per_token"])
        for r in runs:
            w.writerow([r.name, r.tokens, round(r.tokens_per_s, 2), round(r.ttft(0.5)),
                        round(r.ttft(0.99)), r.steps, round(r.span_s, 2),
                        round(r.cpu_s / r.tokens * 1000, 1)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    model = Llama(load_weights())
    smollm2.tokenizer()
    print(f"model loaded in {time.perf_counter() - t:.1f} s; {args.requests} requests at "
          f"{args.rate}/s, answers of {LENGTHS} tokens, {args.threads} torch thread(s)")
    plain = EngineConfig(prefix_cache=False, scheduler=SchedulerConfig(256, 32))
    cached = EngineConfig(prefix_cache=True, scheduler=SchedulerConfig(256, 32))
    batch = args.static_batch
    static_config = EngineConfig(prefix_cache=False,
                                 scheduler=SchedulerConfig(max(256, 128 * batch), batch))
    mix = workload(args.requests, args.rate, args.seed, None)
    runs = [drive("one-at-a-time", model, mix, one_at_a_time, plain),
            drive(f"static batches of {batch}", model, mix, static(batch), static_config),
            drive("continuous", model, mix, continuous, plain)]
    shared = workload(args.requests, args.rate, args.seed, SHARED_SYSTEM)
    runs += [drive("shared prompt, no cache", model, shared, continuous, plain),
             drive("shared prompt, prefix cache", model, shared, continuous, cached)]
    why_not = transformers_peer.available()
    peer = shared_peer = None
    if why_not is None:  # its prefix sharing (allow_block_sharing) is on by default
        reference = transformers_peer.load()
        peer = transformers_peer.drive(reference, mix, 32, 256, Run("transformers continuous"))
        shared_peer = transformers_peer.drive(reference, shared, 32, 256,
                                              Run("transformers, shared prompt"))
        runs += [peer, shared_peer]
    for run in runs:
        report(run)
    write_csv(runs)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f}" + ("  (busy machine: trust the CPU ratios over the wall "
                                        "ones)" if load > 1.5 else ""))
    one, stat, cont, nocache, hit = runs[:5]
    print(f"prompt tokens, shared-prompt mix: {statistics.mean(len(j.prompt) for j in shared):.0f}"
          f" a request on average")
    print(f"continuous / static tokens/s:        {cont.tokens_per_s / stat.tokens_per_s:.2f}x")
    print(f"continuous / one-at-a-time tokens/s: {cont.tokens_per_s / one.tokens_per_s:.2f}x")
    print(f"continuous / static TTFT p50:        {cont.ttft(0.5) / stat.ttft(0.5):.2f}x")
    print(f"prefix cache / none TTFT p50:        {hit.ttft(0.5) / nocache.ttft(0.5):.2f}x")
    print(f"static / continuous CPU per token:   {stat.cpu_s / cont.cpu_s:.2f}x")
    print(f"one-at-a-time / continuous CPU per token: {one.cpu_s / cont.cpu_s:.2f}x")
    print(f"no cache / prefix cache CPU, shared prompt: {nocache.cpu_s / hit.cpu_s:.2f}x")
    if peer is None:
        print(f"transformers peer skipped: {why_not}")
    else:
        print(f"continuous / transformers tokens/s:  {cont.tokens_per_s / peer.tokens_per_s:.2f}x")
        print(f"transformers / continuous CPU per token: "
              f"{(peer.cpu_s / peer.tokens) / (cont.cpu_s / cont.tokens):.2f}x")
    if shared_peer is not None:
        print(f"prefix cache / transformers tokens/s, shared prompt: "
              f"{hit.tokens_per_s / shared_peer.tokens_per_s:.2f}x")
        print(f"prefix cache / transformers TTFT p50, shared prompt: "
              f"{hit.ttft(0.5) / shared_peer.ttft(0.5):.2f}x")


if __name__ == "__main__":
    main()
