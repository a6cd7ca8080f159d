"""CUDA correctness before any figure, for bench/gpu_check.sh: three checks on the device.

    python bench/gpu_correct.py --device cuda --out-dir DIR [--batches 6 --batch 16]

1. overlap: the worker's ModelRunner submits --batches batches back to back (on CUDA each
   one's copy overlaps the one before's forward pass, and the two host buffers are reused;
   on CPU they run in lanes) and collects them; each must give what the same batch gives
   run alone, synchronously (same class ids, scores within 1e-4; bitwise equality noted).
2. out of memory: the model raises torch.cuda.OutOfMemoryError on any batch over a quarter
   of --batch; collect must split the batch until it fits, answer every request with the
   synchronous answer, and lower its batch limit.
3. device error: a ``redbatch worker --model gpu_faults:device_error`` is sent one job; its
   forward pass raises a CUDA error, and the worker must exit with code 3 (its supervisor
   restarts it) without answering the job.

Writes DIR/correct.json (each check's verdict and detail) and exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import torch
from gpu_faults import POISON
from gpu_model import MODEL, filled_slots, profile_variant
from harness import ROOT, set_out_dir
from redbatch.cli.local_stack import spawn_worker, stop_worker
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import Keys
from redbatch.gpu_worker.device.prepare import prepare_model, resolve_device
from redbatch.gpu_worker.device.runner import ModelRunner, Outcome
from redbatch.gpu_worker.tuning.profile import Variant
from redbatch.handlers import load_handler
from redbatch.producer.client import Client

#: Largest difference of a score between two runs of the same batch that still agrees.
SCORE_TOLERANCE = 1e-4


def agree(a: list[Outcome], b: list[Outcome]) -> tuple[bool, bool, float]:
    """(same answers within the tolerance, bitwise equal, largest score difference)."""
    worst = 0.0
    same_ids = len(a) == len(b)
    for x, y in zip(a, b, strict=False):
        if x.error is not None or y.error is not None:
            return False, False, float("inf")
        same_ids &= [t["class_id"] for t in x.output["top5"]] == \
            [t["class_id"] for t in y.output["top5"]]
        worst = max([worst, *(abs(s["score"] - t["score"])
                              for s, t in zip(x.output["top5"], y.output["top5"], strict=True))])
    return same_ids and worst <= SCORE_TOLERANCE, same_ids and worst == 0.0, worst


def overlap(runner: ModelRunner, batches: list[list[int]]) -> tuple[dict[str, Any], list[Any]]:
    alone = [runner.run(ids, [{}] * len(ids)) for ids in batches]
    jobs = [runner.submit(ids, [{}] * len(ids)) for ids in batches]
    together = [runner.collect(job) for job in jobs]
    checks = [agree(s, t) for s, t in zip(alone, together, strict=True)]
    return {"ok": all(c[0] for c in checks), "bitwise": all(c[1] for c in checks),
            "max_score_diff": max(c[2] for c in checks), "batches": len(batches),
            "batch": len(batches[0])}, alone


def failing_over(limit: int, model: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory: batch {x.shape[0]} (injected over {limit})")
        return model(x)

    return forward


def out_of_memory(args: argparse.Namespace, slots: Any, device: torch.device, variant: Variant,
                  reference: list[Outcome]) -> dict[str, Any]:
    handler = load_handler(MODEL, LimitSettings())
    fits = max(1, args.batch // 4)
    model = failing_over(fits, prepare_model(handler.load(device), variant, device))
    runner = ModelRunner(handler, device, slots, args.batch, variant, model=model)
    try:
        outcomes = runner.collect(runner.submit(list(range(args.batch)), [{}] * args.batch))
        same, _, worst = agree(outcomes, reference)
        return {"ok": same and runner.batch_limit <= fits, "batch": args.batch,
                "fits": fits, "batch_limit_after": runner.batch_limit,
                "answered": sum(o.error is None for o in outcomes), "max_score_diff": worst}
    finally:
        runner.close()


def device_error(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    log = out / "device-error-worker.log"
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    code: int | None = None
    with RedisServer() as server, open(log, "wb") as f:
        proc = spawn_worker(server.url, ["--model", "gpu_faults:device_error", "--model-name",
                                         "faulty", "--device", args.device, "--calibrate",
                                         "off", "--metrics-port", "0"],
                            env=env, stdout=f, stderr=subprocess.STDOUT)
        start = time.monotonic()
        try:
            with Client(server.url, model="faulty") as client:
                rid = client.submit(POISON, timeout_s=300)
                code = proc.wait(timeout=args.exit_timeout_s)
            r = redis.Redis.from_url(server.url)
            answered = bool(r.exists(Keys("faulty").result(rid)))
            r.close()
        except subprocess.TimeoutExpired:
            answered = False
        finally:
            stop_worker(proc)
    return {"ok": code == 3 and not answered, "exit_code": code, "answered": answered,
            "exit_s": round(time.monotonic() - start, 1), "log": log.name}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--exit-timeout-s", type=float, default=90.0)
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args()
    out = set_out_dir(args.out_dir)
    device = resolve_device(args.device)
    handler = load_handler(MODEL, LimitSettings())
    slots = filled_slots(handler, args.batches * args.batch)
    chosen, _ = profile_variant(MODEL)
    # The served variant's memory format and precision, not its compilation (minutes).
    variant = Variant(chosen.channels_last, chosen.autocast)
    result: dict[str, Any] = {"device": str(device), "variant": variant.name}
    runner = ModelRunner(handler, device, slots, args.batch, variant, lanes=2)
    try:
        result["overlap"], alone = overlap(runner, [
            list(range(i * args.batch, (i + 1) * args.batch)) for i in range(args.batches)])
    finally:
        runner.close()
    result["out_of_memory"] = out_of_memory(args, slots, device, variant, alone[0])
    (out / "correct.json").write_text(json.dumps(result, indent=1))
    result["device_error"] = device_error(args, out)
    (out / "correct.json").write_text(json.dumps(result, indent=1))
    for name in ("overlap", "out_of_memory", "device_error"):
        print(f"{name}: {'ok' if result[name]['ok'] else 'FAILED'} {result[name]}", flush=True)
    sys.exit(0 if all(result[n]["ok"] for n in ("overlap", "out_of_memory", "device_error"))
             else 1)


if __name__ == "__main__":
    main()
