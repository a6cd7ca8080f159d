"""The text path against the plain alternative: one worker through Redis against
sentence-transformers' own ``encode(batch_size=32)`` in one process, on the same cores.

    .venv/bin/python bench/text_vs_st.py [--texts 1200] [--repeat 3] [--worker-args "..."]

Needs the ``reference`` extra (sentence-transformers; never a dependency of redbatch). The
texts are real sentences (tests/data/sentences.txt) shuffled, joined and cut to word counts
drawn from a long tail: lognormal, median 40 words, clipped to 10-265 (the longest are cut
at the model's 256 tokens, by both sides alike). Each round runs both sides over the same
texts, alternating which goes first:

* **sentence-transformers**: ``SentenceTransformer(<the model's wheel folder>)``, then
  ``encode(texts, batch_size=32, normalize_embeddings=True)`` (it sorts by length, so it
  buckets too), with torch's default threads (one per core); texts/s of that one call.
* **redbatch**: one ``redbatch worker --model all_minilm_l6_v2 --max-batch-size 32``
  (length buckets under its default token budget; its default lanes) on a private
  redis-server, started before the round; the client submits every text in one pipelined
  call and waits for all the results: texts/s from the submit to the last answer.

Both use the same weights; the vectors must match (max absolute difference under 1e-5:
redbatch rounds to 6 decimals). Prints each round, then best and median of the ratios,
last. Writes bench/out/text_vs_st.csv. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import shlex
import statistics
import time
from dataclasses import dataclass

import numpy as np
import psutil
from harness import ROOT, fmt, machine_load, start_worker, write_csv
from redbatch.cli.redis_server import RedisServer
from redbatch.handlers.text import model_dir
from redbatch.producer.client import Client

MODEL = "all_minilm_l6_v2"
SENTENCES = ROOT / "tests" / "data" / "sentences.txt"
MEDIAN_WORDS, SIGMA, MIN_WORDS, MAX_WORDS = 40, 0.8, 10, 265
BATCH = 32


def texts(n: int, seed: int) -> list[str]:
    """``n`` real texts of long-tailed word counts (see the module's docstring)."""
    rng = random.Random(seed)
    words = " ".join(s.strip() for s in SENTENCES.read_text(encoding="utf-8").splitlines()
                     if s.strip()).split()
    out = []
    for _ in range(n):
        count = max(MIN_WORDS, min(MAX_WORDS, round(rng.lognormvariate(
            math.log(MEDIAN_WORDS), SIGMA))))
        start = rng.randrange(len(words))
        out.append(" ".join((words[start:] + words)[:count]))
    return out


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children, now."""
    total = 0.0
    for pid in pids:
        proc = psutil.Process(pid)
        for each in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = each.cpu_times()
                total += t.user + t.system
    return total


def run_st(model: object, items: list[str]) -> Side:
    cpu, start = time.process_time(), time.perf_counter()
    vectors = model.encode(items, batch_size=BATCH, normalize_embeddings=True)  # type: ignore[attr-defined]
    return Side(len(items) / (time.perf_counter() - start),
                (time.process_time() - cpu) * 1000 / len(items),
                np.asarray(vectors, dtype=np.float32))


def run_redbatch(url: str, items: list[str], pids: list[int]) -> Side:
    """Submit every text at once and wait for all; CPU of the worker (its pool too),
    redis-server and this client."""
    with Client(url, model=MODEL) as client:
        cpu, mine = cpu_s(pids), time.process_time()
        start = time.perf_counter()
        handles = client.submit_many(items)
        results = client.results([h.request_id for h in handles], timeout_s=600)
        rate = len(items) / (time.perf_counter() - start)
        cpu = cpu_s(pids) - cpu + time.process_time() - mine
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} texts failed: {bad[0]}")
    return Side(rate, cpu * 1000 / len(items),
                np.asarray([r.output["embedding"] for r in results], dtype=np.float32))


@dataclass
class Side:
    rate: float
    cpu_ms: float
    """CPU milliseconds a text, every process of the side."""
    vectors: np.ndarray


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--texts", type=int, default=1200)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    args = p.parse_args()
    from sentence_transformers import SentenceTransformer

    items = texts(args.texts, seed=3)
    counts = sorted(len(t.split()) for t in items)
    print(f"{len(items)} texts, words: median {counts[len(counts) // 2]}, mean "
          f"{sum(counts) / len(counts):.1f}, max {counts[-1]}; {machine_load()}", flush=True)
    st = SentenceTransformer(str(model_dir()), device="cpu")
    st.encode(items[:64], batch_size=BATCH)  # warm-up
    rows: list[list[object]] = []
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    with RedisServer() as server:
        worker = start_worker(server.url, MODEL, ["--model", MODEL, "--max-batch-size",
                                                  str(BATCH), *shlex.split(args.worker_args)],
                              "text_vs_st-worker.log")
        pids = [worker.pid, *([server.pid] if server.pid else [])]
        try:
            run_redbatch(server.url, items[:64], pids)  # warm-up
            for i in range(args.repeat):
                sides: dict[str, Side] = {}
                for side in (("st", "redbatch") if i % 2 == 0 else ("redbatch", "st")):
                    sides[side] = (run_st(st, items) if side == "st"
                                   else run_redbatch(server.url, items, pids))
                a, b = sides["st"], sides["redbatch"]
                diff = float(np.abs(a.vectors - b.vectors).max())
                ratio, cpu_ratio = b.rate / a.rate, a.cpu_ms / b.cpu_ms
                ratios.append(ratio)
                cpu_ratios.append(cpu_ratio)
                rows.append([i + 1, round(a.rate, 1), round(b.rate, 1), round(ratio, 3),
                             round(a.cpu_ms, 2), round(b.cpu_ms, 2), round(cpu_ratio, 3),
                             f"{diff:.2e}"])
                print(f"  round {i + 1}: sentence-transformers {a.rate:6.1f} texts/s "
                      f"({a.cpu_ms:.1f} CPU-ms a text), redbatch {b.rate:6.1f} texts/s "
                      f"({b.cpu_ms:.1f} CPU-ms), ratio {ratio:.2f} (by CPU {cpu_ratio:.2f}), "
                      f"max |vector difference| {diff:.1e}", flush=True)
                if diff > 1e-5:
                    raise SystemExit(f"vectors differ by {diff:.2e} (over 1e-5)")
        finally:
            worker.stop()
    write_csv("text_vs_st.csv", ["round", "st_texts_per_s", "redbatch_texts_per_s", "ratio",
                                 "st_cpu_ms", "redbatch_cpu_ms", "cpu_ratio", "max_abs_diff"],
              rows)
    print(f"{machine_load()}; wrote bench/out/text_vs_st.csv")
    print(f"RATIO redbatch / sentence-transformers encode(batch_size={BATCH}) texts/s: best "
          f"{fmt(max(ratios), 2)}, median {fmt(statistics.median(ratios), 2)} "
          f"(target >= 1); by CPU a text (sentence-transformers / redbatch): best "
          f"{fmt(max(cpu_ratios), 2)}, median {fmt(statistics.median(cpu_ratios), 2)}")


if __name__ == "__main__":
    main()
