"""What decoding a photo costs, and how many photos/s the preprocessing processes decode.

    .venv/bin/python bench/decode.py [--repeat 40] [--seconds 3] [--cores 16]

Inputs: the three sample photos (JPEG, 451x300 to 640x427) and, made here from each, a
12 MP JPEG (upscaled bicubic to 4000x3000, saved at quality 90) and the same 12 MP picture
as an MPO (a JPEG carrying a second, 1920x1440 preview image, as many cameras write: Pillow
opens it as format MPO). Upscaled pictures are smoother than a camera's, so their files
are smaller (~0.8 MB) and their entropy decoding, which no draft mode shortens, cheaper.

1. ms per photo, median wall and CPU (``time.process_time``) of ``--repeat`` runs in this
   process, of the default model's preprocessing (``EfficientNetLite0.preprocess``: JPEG
   draft, EXIF, resize of the crop region, normalise into a float32 slot), beside the same
   preprocessing from a full-size decode (``open_image`` without a target side: no draft),
   which is also what an MPO cost before the draft applied to it (until issue 13 only
   files of format JPEG were drafted).
2. Photos/s against processes 1..cores: plain processes (spawn), each running the same
   handler's ``preprocess`` in a loop over a mix (the sample photos; the 12 MP JPEGs) for
   ``--seconds``, all started together; photos/s is their total over the wall time. Plain
   processes rather than a PreprocPool: this is decoding's own capacity, without the task
   and record hand-offs (bench/cpu_budget.py measures those).
3. The projection for a ``--cores`` box: one process's rate here times the pool a worker
   starts there by default (gpu_worker/device/prepare.py ``choose_pool_processes``): on CUDA
   cores - 1; on CPU, where the model's default threads take every core, a third of them.
   Assumes cores as fast as these, and linear scaling: each process decodes its own data
   and shares only memory bandwidth. The efficiency measured here at the most processes
   (photos/s over that many times one process's) is printed beside it as a bound; on a
   small, shared box it says more about the neighbours than about decoding.

Prints the tables and the ratios last; writes bench/out/decode.csv and decode.png.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from harness import machine_load, photos, plot, write_csv
from PIL import Image
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.device.prepare import choose_pool_processes
from redbatch.handlers.decode import normalise_into, open_image, resize_center_crop
from redbatch.handlers.imagenet import EfficientNetLite0

BIG_SIZE = (4000, 3000)
PREVIEW_SIZE = (1920, 1440)
NAMES = ("cat", "coffee", "rocket")  # the sample photos, in name order (harness.photos)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=40, help="runs per photo (12 MP: a quarter)")
    p.add_argument("--seconds", type=float, default=3.0, help="each throughput run")
    p.add_argument("--cores", type=int, default=16, help="the box to project to")
    return p.parse_args()


# ---------------------------------------------------------------------------- inputs


def twelve_mp(photo: bytes, preview: bool) -> bytes:
    """``photo`` upscaled to 12 MP, JPEG quality 90; with ``preview``, an MPO that also
    carries a 1920x1440 second image."""
    big = Image.open(io.BytesIO(photo)).convert("RGB").resize(BIG_SIZE,
                                                              Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    if preview:
        big.save(buf, "MPO", save_all=True, quality=90,
                 append_images=[big.resize(PREVIEW_SIZE, Image.Resampling.BICUBIC)])
    else:
        big.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def inputs() -> dict[str, bytes]:
    """name -> payload: the samples, their 12 MP JPEGs and 12 MP MPOs."""
    base = dict(zip(NAMES, photos(), strict=True))
    out = dict(base)
    out.update({f"{n} 12MP": twelve_mp(d, preview=False) for n, d in base.items()})
    out.update({f"{n} 12MP MPO": twelve_mp(d, preview=True) for n, d in base.items()})
    return out


# ---------------------------------------------------------------------------- per photo


@dataclass(frozen=True, slots=True)
class Cost:
    wall_ms: float
    cpu_ms: float


def median_cost(run: Callable[[], None], repeat: int) -> Cost:
    """Median wall and CPU ms of ``run`` after one warm-up run."""
    run()
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        run()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    return Cost(1000 * statistics.median(walls), 1000 * statistics.median(cpus))


def full_size_preprocess(handler: EfficientNetLite0, data: bytes, out: np.ndarray) -> None:
    """The handler's preprocessing from a full-size decode (no draft): the reference."""
    img = open_image(data, handler.limits)
    normalise_into(resize_center_crop(img, handler.resize_to, handler.crop), out,
                   handler.mean, handler.std)


def per_photo(payloads: dict[str, bytes], repeat: int) -> list[tuple[str, Cost, Cost]]:
    """(name, preprocess cost, full-size-decode cost) per input."""
    handler = EfficientNetLite0(LimitSettings())
    out = np.empty(handler.input_shape, np.float32)
    rows = []
    for name, data in payloads.items():
        n = max(5, repeat // 4) if "12MP" in name else repeat
        drafted = median_cost(partial(handler.preprocess, data, "", {}, out), n)
        full = median_cost(partial(full_size_preprocess, handler, data, out), n)
        rows.append((name, drafted, full))
    return rows


# ---------------------------------------------------------------------------- throughput


def _decode_loop(mix: list[bytes], seconds: float, go: Any, done: Any) -> None:
    """A process's run: warm up, wait for ``go``, preprocess the mix round-robin for
    ``seconds``, put the count on ``done``."""
    handler = EfficientNetLite0(LimitSettings())
    out = np.empty(handler.input_shape, np.float32)
    for data in mix:
        handler.preprocess(data, "", {}, out)
    go.wait()
    end, count = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        handler.preprocess(mix[count % len(mix)], "", {}, out)
        count += 1
    done.put(count)


def throughput(mix: list[bytes], processes: int, seconds: float) -> float:
    """Photos/s of ``processes`` plain processes preprocessing ``mix`` together."""
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_decode_loop, args=(mix, seconds, go, done))
             for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(1.5)  # spawn, imports and the warm-up run
    start = time.perf_counter()
    go.set()
    total = sum(done.get(timeout=seconds + 60) for _ in procs)
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    return total / wall


def scaling(mixes: dict[str, list[bytes]], cores: int,
            seconds: float) -> dict[str, dict[int, float]]:
    """mix name -> processes -> photos/s, for 1..cores processes."""
    return {name: {n: throughput(mix, n, seconds) for n in range(1, cores + 1)}
            for name, mix in mixes.items()}


# ---------------------------------------------------------------------------- report


def default_pools(cores: int) -> dict[str, int]:
    """The pool a worker starts by default on a ``cores`` box: on CUDA, and on CPU with the
    default 2 lanes of cores / 2 torch threads each."""
    return {"CUDA": choose_pool_processes(0, "cuda", 1, 1, cores),
            "CPU": choose_pool_processes(0, "cpu", 2, max(1, cores // 2), cores)}


def print_per_photo(rows: list[tuple[str, Cost, Cost]]) -> None:
    print(f"\n{'photo':20s} {'preprocess wall ms':>19s} {'CPU ms':>8s} "
          f"{'full-size decode wall':>22s} {'CPU ms':>8s}")
    for name, d, f in rows:
        print(f"{name:20s} {d.wall_ms:19.2f} {d.cpu_ms:8.2f} {f.wall_ms:22.2f} {f.cpu_ms:8.2f}")


def print_scaling(rates: dict[str, dict[int, float]], cores: int) -> None:
    print(f"\n{'mix':20s} {'processes':>9s} {'photos/s':>9s}")
    for mix, by_n in rates.items():
        for n, rate in by_n.items():
            print(f"{mix:20s} {n:9d} {rate:9.1f}")
    for mix, by_n in rates.items():
        most = max(by_n)
        efficiency = by_n[most] / (most * by_n[1])
        for device, pool in default_pools(cores).items():
            rate = by_n[1] * pool
            print(f"projection, {cores}-core box, a {device} worker's default pool of {pool}, "
                  f"{mix}: {rate:,.0f} photos/s ({by_n[1]:.1f}/s per process x {pool}; "
                  f"{rate * efficiency:,.0f} at the {efficiency:.2f} efficiency measured "
                  f"here at {most} processes)")


def kind(name: str) -> str:
    """Which group an input belongs to: the samples, the 12 MP JPEGs or the 12 MP MPOs."""
    return "12 MP MPO" if name.endswith("MPO") else "12 MP JPEG" if "12MP" in name \
        else "sample photos"


def print_ratios(rows: list[tuple[str, Cost, Cost]], rates: dict[str, dict[int, float]]) -> None:
    print()
    for group in ("sample photos", "12 MP JPEG", "12 MP MPO"):
        picked = [r for r in rows if kind(r[0]) == group]
        d = statistics.mean(r[1].cpu_ms for r in picked)
        f = statistics.mean(r[2].cpu_ms for r in picked)
        print(f"RATIO preprocess / full-size-decode preprocess, CPU ms, {group}: "
              f"{d:.2f} / {f:.2f} = {d / f:.2f}")
    for mix, by_n in rates.items():
        most = max(by_n)
        print(f"RATIO photos/s at {most} processes / {most} x 1 process, {mix}: "
              f"{by_n[most]:.1f} / {most * by_n[1]:.1f} = {by_n[most] / (most * by_n[1]):.2f}")


def save(rows: list[tuple[str, Cost, Cost]], rates: dict[str, dict[int, float]]) -> Path:
    header = ("measure", "input", "processes", "wall_ms", "cpu_ms", "photos_per_s")
    lines: list[tuple[Any, ...]] = []
    for name, d, f in rows:
        lines.append(("preprocess", name, 1, round(d.wall_ms, 3), round(d.cpu_ms, 3), ""))
        lines.append(("full_size_decode", name, 1, round(f.wall_ms, 3), round(f.cpu_ms, 3), ""))
    for mix, by_n in rates.items():
        lines.extend(("throughput", mix, n, "", "", round(r, 1)) for n, r in by_n.items())
    write_csv("decode.csv", header, lines)
    return plot("decode.png", lambda plt: _figure(plt, rows, rates))


def _figure(plt: Any, rows: list[tuple[str, Cost, Cost]],
            rates: dict[str, dict[int, float]]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    names = [r[0] for r in rows]
    y = np.arange(len(names))
    left.barh(y - 0.2, [r[1].cpu_ms for r in rows], 0.4, label="preprocess (draft)")
    left.barh(y + 0.2, [r[2].cpu_ms for r in rows], 0.4, label="full-size decode", color="gray")
    left.set_yticks(y, names)
    left.invert_yaxis()
    left.set_xlabel("CPU ms per photo (median; lower is better)")
    left.legend()
    for mix, by_n in rates.items():
        right.plot(list(by_n), list(by_n.values()), marker="o", label=mix)
    right.set_xticks(sorted({n for by_n in rates.values() for n in by_n}))
    right.set_xlabel("processes")
    right.set_ylabel("photos/s (higher is better)")
    right.legend()
    fig.suptitle(f"decode (EfficientNet-Lite0 preprocessing); {machine_load()}", fontsize=9)


def main() -> None:
    args = parse_args()
    cores = os.cpu_count() or 1
    print(f"bench/decode.py: {machine_load()}")
    payloads = inputs()
    rows = per_photo(payloads, args.repeat)
    print_per_photo(rows)
    mixes = {"sample photos": [payloads[n] for n in NAMES],
             "12 MP JPEGs": [payloads[f"{n} 12MP"] for n in NAMES]}
    rates = scaling(mixes, cores, args.seconds)
    print_scaling(rates, args.cores)
    print_ratios(rows, rates)
    print(f"wrote {save(rows, rates)}")


if __name__ == "__main__":
    main()
