"""End-to-end throughput against four baselines, measured in one run on this machine.

    .venv/bin/python bench/throughput.py [--images 600] [--max-batch-size N] [--plain-images 320]
                                        [--repeat 1] [--worker-args "..."]

1. redbatch: a private redis-server and one `redbatch worker` process as shipped (its own
           pool and torch threads, and its calibration profile: loaded, or measured and
           stored at its first start); a client submits every image at once and waits for
           all. Its start-up log says which max batch size and model variant it chose;
2. ideal:  one process decodes, batches and runs the same model, the same variant
           (channels_last, compile) and the same max batch size in a plain loop, no Redis,
           all cores for torch (what you would write by hand for an offline job);
3. one-at-a-time: the same model and variant serving one request at a time, decode then
           forward, batch 1, in process (no Redis);
4. redbatch, batch 1: the same worker with --max-batch-size 1 (what batching adds inside
           redbatch); every worker after the first starts with --calibrate load, so the
           whole run uses the one profile;
5. plain script: bench/plain_script.py in a subprocess, what a user writes first: Pillow decode,
           the eager model in batches of 16, default torch threads and glibc's default malloc
           (run without the worker's MALLOC_* variables).

1-4 run under the same malloc settings (the worker's, see gpu_worker/device/malloc_tuning.py): the
script re-executes itself with them, so the comparison is of the pipeline, not of glibc.

With --repeat N every variant runs N times, interleaved, and the medians (of the rates, and
of the ratios measured within each round) are reported: use it on a busy machine.

Prints throughputs, latency percentiles and the batch-size histogram, then the ratios last
with their targets (issue 6: redbatch / ideal >= 0.9, redbatch / plain script >= 2.5).
Writes bench/out/throughput.csv and bench/out/throughput.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from harness import (
    fmt,
    latency_summary,
    machine_load,
    plot_rates,
    reexec_with_worker_malloc,
    start_worker,
    untuned_env,
    verdict,
    workload,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.device import malloc_tuning
from redbatch.handlers import EfficientNetLite0
from redbatch.producer.client import Client

HERE = Path(__file__).resolve().parent
MODEL = "efficientnet_lite0"
TARGET_VS_IDEAL = 0.9
TARGET_VS_PLAIN = 2.5
#: Variants: CSV name -> label in the output.
VARIANTS = {"redbatch": "redbatch end to end",
            "ideal_in_process": "ideal in-process loop",
            "plain_script": "plain script (Pillow, batch 16, untuned)",
            "one_at_a_time": "one request at a time",
            "redbatch_batch_1": "redbatch, max batch 1"}


def load_variant(variant: str) -> tuple[EfficientNetLite0, Callable[[torch.Tensor], torch.Tensor],
                                        bool]:
    """The handler and the model prepared as the worker runs it (variant named in its log:
    memory format, compile, autocast), and whether inputs go channels_last."""
    handler = EfficientNetLite0(LimitSettings())
    model = handler.load(torch.device("cpu"))
    try:
        from redbatch.gpu_worker.device.prepare import precision, prepare_model
        from redbatch.gpu_worker.tuning.variants import parse_variant

        v = parse_variant(variant)
        prepared = prepare_model(model, v, torch.device("cpu"))
    except (ImportError, ValueError) as e:
        print(f"NOTE: in-process baselines run eager: variant {variant!r} unusable ({e})")
        return handler, model, False

    def forward(x: torch.Tensor) -> torch.Tensor:
        with precision("cpu", v.autocast):
            out: torch.Tensor = prepared(x)
        return out.float()

    return handler, forward, v.channels_last


def in_process(payloads: list[bytes], batch_size: int, variant: str) -> float:
    """Images per second of a plain decode-batch-forward loop in this process."""
    torch.set_num_threads(os.cpu_count() or 1)
    handler, model, channels_last = load_variant(variant)
    buf = np.empty((batch_size, *handler.input_shape), np.float32)

    def forward(n: int) -> torch.Tensor:
        x = torch.from_numpy(buf[:n])
        return model(x.contiguous(memory_format=torch.channels_last) if channels_last else x)

    with torch.inference_mode():
        for n in {batch_size, len(payloads) % batch_size} - {0}:  # warm-up (compile) each shape
            forward(n)
        start = time.perf_counter()
        for i in range(0, len(payloads), batch_size):
            chunk = payloads[i:i + batch_size]
            for j, data in enumerate(chunk):
                handler.preprocess(data, "", {}, buf[j])
            handler.postprocess(forward(len(chunk)), [{}] * len(chunk))
    return len(payloads) / (time.perf_counter() - start)


def plain_script(images: int, batch_size: int) -> float:
    """bench/plain_script.py in a fresh process with glibc's default malloc: images/s."""
    out = subprocess.run([sys.executable, str(HERE / "plain_script.py"), "--images", str(images),
                          "--batch-size", str(batch_size)], env=untuned_env(), check=True,
                         capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["images_per_s"])


class RedbatchRun:
    """One measured pass through a fresh worker: rate, latencies, batch sizes, its choices."""

    def __init__(self, payloads: list[bytes], worker_args: list[str], log_name: str) -> None:
        with RedisServer() as server:
            worker = start_worker(server.url, MODEL, worker_args, log_name)
            try:
                with Client(server.url) as client:
                    client.predict(payloads[0], timeout_s=300)  # first-request costs
                    start = time.perf_counter()
                    ids = client.submit_many(payloads, timeout_s=3600)
                    results = [client.result(i, timeout_s=3600) for i in ids]
                    elapsed = time.perf_counter() - start
            finally:
                worker.stop()
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        self.rate = len(payloads) / elapsed
        self.latencies = [r.timings["total_ms"] for r in results]
        self.sizes = Counter(r.batch_size for r in results)
        self.worker = worker


def one_round(args: argparse.Namespace, payloads: list[bytes],
              first: bool) -> tuple[dict[str, float], RedbatchRun]:
    """Every variant once; redbatch first, since the others copy its max batch and variant."""
    extra = shlex.split(args.worker_args)
    fixed = ["--max-batch-size", str(args.max_batch_size)] if args.max_batch_size else []
    calibrate = [] if first else ["--calibrate", "load"]
    ours = RedbatchRun(payloads, [*calibrate, *fixed, *extra], "throughput-worker.log")
    batch = ours.worker.max_batch or max(ours.sizes)
    n_single, n_single_rb = max(50, args.images // 4), max(50, args.images // 2)
    rates = {"redbatch": ours.rate,
             "ideal_in_process": in_process(payloads, batch, ours.worker.variant),
             "plain_script": plain_script(args.plain_images, args.plain_batch_size),
             "one_at_a_time": in_process(payloads[:n_single], 1, ours.worker.variant)}
    rates["redbatch_batch_1"] = RedbatchRun(
        payloads[:n_single_rb], ["--calibrate", "load", *extra, "--max-batch-size", "1"],
        "throughput-worker-batch1.log").rate
    return rates, ours


def draw(rates: dict[str, float], title: str) -> None:
    plot_rates("throughput.png", rates, title, "images / s", "%.1f", 4.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--max-batch-size", type=int, default=0,
                        help="pass --max-batch-size to the worker (default: its own choice)")
    parser.add_argument("--plain-images", type=int, default=320,
                        help="images for the plain-script baseline")
    parser.add_argument("--plain-batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of all variants; medians and median ratios are reported")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    args = parser.parse_args()
    reexec_with_worker_malloc()
    load_before = machine_load()
    payloads = workload(args.images)
    rounds = [one_round(args, payloads, first=i == 0) for i in range(args.repeat)]
    report(args, rounds, load_before)


def report(args: argparse.Namespace, rounds: list[tuple[dict[str, float], RedbatchRun]],
           load_before: str) -> None:
    med = {k: statistics.median(r[0][k] for r in rounds) for k in VARIANTS}
    lat = latency_summary([x for r in rounds for x in r[1].latencies])
    sizes = sum((r[1].sizes for r in rounds), Counter())
    worker = rounds[0][1].worker
    batch = worker.max_batch or max(sizes)

    def ratio(a: str, b: str) -> float:
        """Median over rounds of a / b, each ratio measured within one round."""
        return statistics.median(r[0][a] / r[0][b] for r in rounds)

    batch_of = {"redbatch_batch_1": 1, "one_at_a_time": 1, "plain_script": args.plain_batch_size}
    write_csv("throughput.csv", ["variant", "images_per_s_median", "rounds_images_per_s",
                                 "max_batch_size", "model_variant", "images", "p50_ms",
                                 "p99_ms"],
              [[k, fmt(med[k], 2), " ".join(fmt(r[0][k], 2) for r in rounds),
                batch_of.get(k, batch), "eager" if k == "plain_script" else worker.variant,
                args.plain_images if k == "plain_script" else args.images,
                fmt(lat["p50"]) if k == "redbatch" else "",
                fmt(lat["p99"]) if k == "redbatch" else ""] for k in VARIANTS])
    draw({VARIANTS[k]: med[k] for k in VARIANTS},
         f"EfficientNet-Lite0 on {os.cpu_count()} CPU cores; redbatch: {worker.describe()}; "
         f"median of {args.repeat}")

    print(f"cores={os.cpu_count()} images={args.images} repeat={args.repeat} "
          f"worker_args={args.worker_args!r} ({malloc_tuning.describe()})")
    print(f"worker (first round): {worker.describe()}; log {worker.log}")
    for line in worker.tuning:
        print(f"  tuning: {line}")
    print(f"before: {load_before}; after: {machine_load()}")
    for k, label in VARIANTS.items():
        per_round = "" if args.repeat == 1 else \
            "  (" + ", ".join(fmt(r[0][k]) for r in rounds) + ")"
        print(f"{label:42s} {med[k]:8.1f} img/s{per_round}")
    print(f"latency under saturation   p50 {lat['p50']:.0f} ms  p95 {lat['p95']:.0f} ms  "
          f"p99 {lat['p99']:.0f} ms  (mean {lat['mean']:.0f} ms; every image submitted at once)")
    print(f"requests by batch size     {dict(sorted(sizes.items()))}")
    print("wrote bench/out/throughput.csv, bench/out/throughput.png")
    vs_ideal, vs_plain = ratio("redbatch", "ideal_in_process"), ratio("redbatch", "plain_script")
    print(f"RATIO redbatch / one-at-a-time serving  = {ratio('redbatch', 'one_at_a_time'):.2f}")
    print(f"RATIO redbatch / redbatch at batch 1    = {ratio('redbatch', 'redbatch_batch_1'):.2f}")
    print(f"RATIO redbatch / ideal in-process       = {vs_ideal:.2f}  "
          f"(target >= {TARGET_VS_IDEAL}: {verdict(vs_ideal, TARGET_VS_IDEAL)})")
    print(f"RATIO redbatch / plain script           = {vs_plain:.2f}  "
          f"(target >= {TARGET_VS_PLAIN}: {verdict(vs_plain, TARGET_VS_PLAIN)})")


if __name__ == "__main__":
    main()
