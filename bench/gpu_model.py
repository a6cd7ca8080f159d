"""The model alone on the device, for bench/gpu_check.sh: forward passes only, and the
worker's serial device path, at each batch size; the best images/s of each.

    python bench/gpu_model.py --device cuda --sizes 1,8,32,128,256 --out-dir DIR [--runs 20]

Inputs are the sample photos, preprocessed once into slots as the pool would. The variant
is the calibration's choice (the profile in REDBATCH_PROFILE_DIR, as a worker loads it),
else eager. ``forward``: the input already on the device, only ``model(x)`` timed (synced).
``serial``: the worker's ModelRunner, one batch at a time (gather from the slots, copy in,
forward, copy out, postprocess; no overlap). Writes DIR/model.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import photos, set_out_dir
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.device.prepare import precision, prepare_model, resolve_device
from redbatch.gpu_worker.device.runner import ModelRunner
from redbatch.gpu_worker.tuning.profile import Variant, default_profile_dir, load_profile
from redbatch.handlers import Handler, load_handler

MODEL = "efficientnet_lite0"


def filled_slots(handler: Handler, n: int) -> np.ndarray:
    """``n`` slots holding the sample photos, preprocessed, in turn."""
    base = photos()
    slots = np.empty((n, *handler.input_shape), dtype=handler.input_dtype)
    for i in range(n):
        handler.preprocess(base[i % len(base)], "image/jpeg", {}, slots[i])
    return slots


def profile_variant(model: str) -> tuple[Variant, str]:
    """The variant of the newest profile of ``model`` in the profile folder, and its file."""
    found = sorted(default_profile_dir().glob(f"{model}--*.json"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        return Variant(), "no profile: eager"
    return load_profile(found[-1]).choice.variant, found[-1].name


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], Any], device: torch.device, runs: int, warmup: int) -> float:
    """Median seconds of ``run()`` (synced each time) after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    sync(device)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def forward_rates(handler: Handler, slots: np.ndarray, device: torch.device, variant: Variant,
                  sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Images/s of ``model(x)`` alone at each size."""
    model = prepare_model(handler.load(device), variant, device)
    rates = {}
    for size in sizes:
        x = torch.from_numpy(slots[:size]).to(device)
        if variant.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)

        def run(x: torch.Tensor = x) -> None:
            with torch.inference_mode(), precision(device.type, variant.autocast):
                model(x)

        rates[size] = size / timed(run, device, args.runs, args.warmup)
    return rates


def serial_rates(handler: Handler, slots: np.ndarray, device: torch.device, variant: Variant,
                 sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Images/s of the worker's device path, one batch at a time."""
    runner = ModelRunner(handler, device, slots, max(sizes), variant)

    def batch_of(size: int) -> Callable[[], Any]:
        return lambda: runner.run(list(range(size)), [{}] * size)

    try:
        return {size: size / timed(batch_of(size), device, args.runs, args.warmup)
                for size in sizes}
    finally:
        runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="1,8,32,128,256")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args()
    out = set_out_dir(args.out_dir)
    device = resolve_device(args.device)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    handler = load_handler(MODEL, LimitSettings())
    slots = filled_slots(handler, max(sizes))
    variant, source = profile_variant(MODEL)
    result: dict[str, Any] = {"model": MODEL, "device": str(device), "variant": variant.name,
                              "variant_from": source}
    for name, measure in (("forward", forward_rates), ("serial", serial_rates)):
        rates = measure(handler, slots, device, variant, sizes, args)
        best = max(rates, key=lambda s: rates[s])
        result[name] = {"per_s": {str(s): round(r, 1) for s, r in rates.items()},
                        "best_batch": best, "best_per_s": rates[best]}
        (out / "model.json").write_text(json.dumps(result, indent=1))  # partial, as it goes
        print(f"{name}: best {rates[best]:.1f} img/s at batch {best} ({variant.name})",
              flush=True)


if __name__ == "__main__":
    main()
