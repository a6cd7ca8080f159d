"""Two models, one worker against one worker each: throughput, the device's split, memory.

    .venv/bin/python bench/multi_model.py [--seconds 20] [--window 32]

The image model (efficientnet_lite0, real photos) and the text model (all_minilm_l6_v2,
real sentences) on one private redis-server, both saturated at once by a closed loop each
(--window jobs in flight per model), in two modes, one after the other:

  shared    one `redbatch worker --model efficientnet_lite0 --model all_minilm_l6_v2`
  separate  one `redbatch worker --model ...` per model, side by side

For each mode it prints each model's answers per second, the sum of its batches' run times
(redbatch_inference_seconds_sum, over the steady phase; on CPU lanes a batch's run time
also holds its wait to be collected behind the batch launched before it) and the peak
memory (RSS) of the worker processes and their pools. The shared worker offers the device
to the model that used the least of it (gpu_worker/batching/scheduler.py); separate workers split
it however their threads happen to compete. On a small CPU the pool and the lanes share
the same cores, so which part limits each model moves with the machine's load: read it
on a GPU machine for the device's split. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import re
import threading
import urllib.request

from harness import (
    ROOT,
    ClosedRun,
    RedbatchTarget,
    RssSampler,
    closed_loop,
    machine_load,
    photos,
    start_worker,
)
from redbatch.cli.redis_server import RedisServer

IMAGE, TEXT = "efficientnet_lite0", "all_minilm_l6_v2"
SENTENCES = ROOT / "tests" / "data" / "sentences.txt"


def device_seconds(port: int) -> dict[str, float]:
    """Each model's batches' run time so far, s (redbatch_inference_seconds_sum)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m: float(v) for m, v in re.findall(
        r'redbatch_inference_seconds_sum\{model="([^"]+)"\} ([0-9.e+]+)', text)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def saturate(url: str, args: argparse.Namespace) -> dict[str, ClosedRun]:
    """Both models' closed loops at once: a warm-up, then the steady phase recorded."""
    texts = [s for s in SENTENCES.read_text(encoding="utf-8").splitlines() if s.strip()]
    payloads: dict[str, list[bytes | str]] = {IMAGE: list(photos()), TEXT: list(texts)}
    runs: dict[str, ClosedRun] = {}

    def loop(model: str) -> None:
        target = RedbatchTarget(url, model, payloads[model])
        try:
            runs[model] = closed_loop(url, target, args.window, args.seconds,
                                      warmup_s=args.warmup_s)
        finally:
            target.close()

    threads = [threading.Thread(target=loop, args=(m,)) for m in (IMAGE, TEXT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs


def run_mode(name: str, args: argparse.Namespace) -> None:
    common = ["--max-batch-size", str(args.max_batch_size), "--calibrate", "off"]
    with RedisServer() as server, RssSampler(0) as rss:
        ports = [free_port(), free_port()]
        if name == "shared":
            workers = [start_worker(server.url, IMAGE, ["--model", IMAGE, "--model", TEXT,
                                                        *common], "multi-shared.log",
                                    metrics_port=ports[0])]
        else:
            workers = [start_worker(server.url, model, ["--model", model, *common],
                                    f"multi-separate-{model}.log", metrics_port=port)
                       for model, port in zip((IMAGE, TEXT), ports, strict=True)]
        samplers = [rss] + [RssSampler(w.pid) for w in workers[1:]]
        rss.watch(workers[0].pid)
        for extra in samplers[1:]:
            extra.__enter__()
        try:
            before = merged(ports[:len(workers)])
            runs = saturate(server.url, args)
            after = merged(ports[:len(workers)])
        finally:
            for extra in samplers[1:]:
                extra.__exit__()
            for w in workers:
                w.stop()
    used = {m: after.get(m, 0.0) - before.get(m, 0.0) for m in (IMAGE, TEXT)}
    total = sum(used.values()) or float("nan")
    memory = sum(s.peak for s in samplers) / 2**20
    for model in (IMAGE, TEXT):
        print(f"  {name:8s} {model:18s} {runs[model].throughput:7.1f} jobs/s  device "
              f"{used[model]:6.1f} s ({used[model] / total:5.1%})", flush=True)
    print(f"  {name:8s} workers' peak memory {memory:7.0f} MiB", flush=True)


def merged(ports: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for port in ports:
        out.update(device_seconds(port))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="steady phase, s")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--window", type=int, default=32, help="jobs in flight per model")
    p.add_argument("--max-batch-size", type=int, default=16)
    args = p.parse_args()
    print(f"load average {machine_load()}", flush=True)
    for name in ("shared", "separate"):
        run_mode(name, args)


if __name__ == "__main__":
    main()
