"""Text batching: length buckets + a token budget against plain size batching against batch 1.

    .venv/bin/python bench/bucketing.py [--capacity-s 15] [--seconds 15] [--load 0.7]
                                        [--max-batch-size 32] [--max-batch-tokens 2048]

The text model (all_minilm_l6_v2) on one private redis-server and one `redbatch worker`
per mode, all in one run, in this order:

  plain     --max-batch-size N --max-batch-tokens 0   (batches padded to their longest)
  bucketed  --max-batch-size N --max-batch-tokens T   (length buckets, T padded tokens)
  batch-1   --max-batch-size 1                        (no padding, no batching)

The texts are real sentences (tests/data/sentences.txt) joined and cut to lengths drawn
from a long-tailed distribution: lognormal, median 24 tokens, clipped to 5-256, as
sentence and query lengths are (most short, a few long). For each mode:

1. warm-up: a few seconds of saturated traffic, not recorded;
2. capacity: a closed loop keeping --window jobs in flight for --capacity-s; answers per
   second, and the padding waste of its batches from the worker's own counters
   (redbatch_batch_tokens_total: padded tokens / real tokens; 1.0 is none);
3. latency: Poisson arrivals at --load x the plain mode's capacity for --seconds, the same
   offered rate for every mode (open loop, timed from each scheduled arrival): p50/p99.

Prints one row per mode and the ratios the issue asks for (bucketed / plain throughput,
p99s at the same load, waste). Writes bench/out/bucketing.csv. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness import (
    ROOT,
    ClosedRun,
    OpenRun,
    RedbatchTarget,
    closed_loop,
    fmt,
    latency_summary,
    machine_load,
    open_loop,
    start_worker,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer
from redbatch.handlers.text import MAX_TOKENS, tokenizer

MODEL = "all_minilm_l6_v2"
SENTENCES = ROOT / "tests" / "data" / "sentences.txt"
#: Length mix: lognormal with this median (tokens) and sigma, clipped to [MIN, MAX_TOKENS].
MEDIAN_TOKENS, SIGMA, MIN_TOKENS = 24, 0.9, 5


def text_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(MIN_TOKENS, min(MAX_TOKENS, round(rng.lognormvariate(math.log(MEDIAN_TOKENS),
                                                                       SIGMA))))
            for _ in range(n)]


def texts_of_lengths(lengths: list[int], seed: int) -> list[str]:
    """Real sentences, shuffled and joined, cut to each length in tokens ([CLS] and [SEP]
    included, as the model counts them)."""
    rng = random.Random(seed)
    corpus = [s for s in SENTENCES.read_text(encoding="utf-8").splitlines() if s.strip()]
    tok = tokenizer()
    out = []
    for length in lengths:
        rng.shuffle(corpus)
        joined = " ".join(corpus)
        enc = tok.encode(joined)
        words = length - 2  # [CLS] and [SEP]
        end = enc.offsets[min(words, len(enc.offsets) - 2)][1]
        out.append(joined[:end])
    return out


@dataclass
class Mode:
    name: str
    args: list[str]
    capacity: ClosedRun | None = None
    waste: float = float("nan")
    latency: OpenRun | None = None


def token_counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {k: float(v) for k, v in
            re.findall(r'redbatch_batch_tokens_total\{kind="(\w+)",[^}]*\} ([0-9.e+]+)', text)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(mode: Mode, texts: list[str], args: argparse.Namespace, rate: float | None) -> None:
    """Capacity (and waste) of one mode, then its latency at ``rate`` (None: its first
    run, the plain mode, whose capacity sets the rate)."""
    port = free_port()
    with RedisServer() as server:
        worker = start_worker(server.url, MODEL, [*mode.args, "--model", MODEL,
                                                  "--max-wait-ms", str(args.max_wait_ms)],
                              f"bucketing-{mode.name}.log", metrics_port=port)
        try:
            target = RedbatchTarget(server.url, MODEL, texts)
            closed_loop(server.url, target, args.window, args.warmup_s)
            before = token_counts(port)
            mode.capacity = closed_loop(server.url, target, args.window, args.capacity_s)
            after = token_counts(port)
            real = after.get("real", 0) - before.get("real", 0)
            padded = after.get("padded", 0) - before.get("padded", 0)
            mode.waste = padded / real if real else float("nan")
            offered = rate if rate is not None else args.load * mode.capacity.throughput
            mode.latency = open_loop(server.url, target, offered, args.seconds, seed=7)
            target.close()
        finally:
            worker.stop()
    lat = latency_summary(mode.latency.latencies())
    print(f"  {mode.name:9s} capacity {mode.capacity.throughput:7.1f} texts/s  waste "
          f"{mode.waste:5.2f}x  at {mode.latency.rate:6.1f}/s: answered "
          f"{mode.latency.achieved:6.1f}/s  p50 {lat['p50']:7.1f}  p99 {lat['p99']:7.1f} ms",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--texts", type=int, default=3000, help="distinct texts, cycled")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--capacity-s", type=float, default=15.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--load", type=float, default=0.7, help="share of plain's capacity offered")
    args = p.parse_args()
    lengths = text_lengths(args.texts, seed=1)
    texts = texts_of_lengths(lengths, seed=2)
    print(f"{len(texts)} texts, tokens: median {sorted(lengths)[len(lengths) // 2]}, "
          f"mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}; {machine_load()}",
          flush=True)
    n = str(args.max_batch_size)
    modes = [Mode("plain", ["--max-batch-size", n, "--max-batch-tokens", "0"]),
             Mode("bucketed", ["--max-batch-size", n,
                               "--max-batch-tokens", str(args.max_batch_tokens)]),
             Mode("batch-1", ["--max-batch-size", "1", "--max-batch-tokens", "0"])]
    rate = None
    for mode in modes:
        measure(mode, texts, args, rate)
        assert mode.capacity is not None
        rate = rate or args.load * mode.capacity.throughput
    report(modes)


def report(modes: list[Mode]) -> None:
    rows = []
    for m in modes:
        assert m.capacity is not None and m.latency is not None
        lat = latency_summary(m.latency.latencies())
        rows.append([m.name, " ".join(m.args), round(m.capacity.throughput, 1),
                     round(m.waste, 3), round(m.latency.rate, 1), round(m.latency.achieved, 1),
                     round(lat["p50"], 1), round(lat["p99"], 1)])
    path = write_csv("bucketing.csv", ["mode", "worker_args", "capacity_per_s", "padding_waste",
                                   "offered_per_s", "answered_per_s", "p50_ms", "p99_ms"], rows)
    plain, bucketed = modes[0], modes[1]
    assert plain.capacity and bucketed.capacity and plain.latency and bucketed.latency
    p99 = {m.name: latency_summary(m.latency.latencies())["p99"] for m in modes if m.latency}
    print(f"bucketed / plain throughput: "
          f"{fmt(bucketed.capacity.throughput / plain.capacity.throughput, 2)}x (target >= 1.5); "
          f"p99 at the same load: bucketed {fmt(p99['bucketed'])} ms, plain "
          f"{fmt(p99['plain'])} ms, batch-1 {fmt(p99['batch-1'])} ms; waste: bucketed "
          f"{fmt(bucketed.waste, 2)}x (target < 1.2), plain {fmt(plain.waste, 2)}x")
    print(f"wrote {Path(path).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
