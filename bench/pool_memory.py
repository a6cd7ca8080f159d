"""A preprocessing process's memory around one huge image: before, at its peak, and after.

    .venv/bin/python bench/pool_memory.py [--side 8000] [--rounds 20]

One real pool process of the default model, under the worker's glibc malloc settings (the
script re-executes itself with them, as `redbatch worker` does, and pool processes inherit
them), decodes the sample photos, then one SIDE x SIDE RGBA PNG of one colour (a few
hundred KB of file, SIDE^2 x 4 bytes of pixels, inside the default pixel limit at 8000),
then the photos again. Prints the process's RSS before, its peak (VmHWM), its RSS 0, 0.5,
1 and 3 s after the PNG's record came back, and the median wall ms per photo before and
after; last the ratio of the RSS after to before. Run it on two commits to compare them.
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import sys
import time
from pathlib import Path

import psutil
from PIL import Image
from redbatch.common.config import LimitSettings, PoolSettings
from redbatch.gpu_worker.device import malloc_tuning
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotArray
from redbatch.preproc_worker.worker import PreprocDone

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def huge_png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGBA", (side, side), (200, 120, 40, 128)).save(buf, "PNG", compress_level=9)
    return buf.getvalue()


def peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


class OnePool:
    """One pool process decoding into slot 0, one task at a time."""

    def __init__(self) -> None:
        self.slots = SlotArray.create(4, (3, 224, 224), "float32")
        self.pool = PreprocPool("efficientnet_lite0", LimitSettings(),
                                PoolSettings(processes=1), self.slots.layout)
        self.records: queue.Queue[list[PreprocDone]] = queue.Queue()
        self.pool.start(self.records.put)
        self.process = psutil.Process(self.pool.pids()[0])

    def decode(self, data: bytes) -> float:
        """Wall ms of one decode, as the process measured it."""
        self.pool.submit(0, data, "", {})
        [record] = self.pool.complete(self.records.get(timeout=300))
        assert record.error_code is None, record
        return float(record.preprocess_ms)

    def rss_mib(self) -> float:
        return float(self.process.memory_info().rss) / 2**20

    def close(self) -> None:
        self.pool.close()
        self.slots.close()


def median_ms(pool: OnePool, photos: list[bytes], rounds: int) -> float:
    times = sorted(pool.decode(p) for _ in range(rounds) for p in photos)
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if malloc_tuning.wanted():  # as the worker runs: its pool processes inherit these
        env = {**os.environ, **malloc_tuning.MALLOC_ENV}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    photos = [p.read_bytes() for p in sorted(SAMPLES.glob("*.jpg"))]
    png = huge_png(args.side)
    pool = OnePool()
    try:
        median_ms(pool, photos, 2)  # warm up
        before_ms, before = median_ms(pool, photos, args.rounds), pool.rss_mib()
        print(f"photos: median {before_ms:.2f} ms; RSS {before:.0f} MiB")
        print(f"{args.side}x{args.side} RGBA PNG of {len(png) // 1024} KB: decoded in "
              f"{pool.decode(png):.0f} ms; peak {peak_mib(pool.process.pid):.0f} MiB")
        done = time.monotonic()
        for after_s in (0.0, 0.5, 1.0, 3.0):
            time.sleep(max(0.0, done + after_s - time.monotonic()))
            print(f"  RSS {after_s:.1f} s after: {pool.rss_mib():.0f} MiB")
        after_ms, after = median_ms(pool, photos, args.rounds), pool.rss_mib()
        print(f"photos after: median {after_ms:.2f} ms; RSS {after:.0f} MiB")
        print(f"RSS after / before the PNG: {after / before:.2f}; "
              f"photo decode after / before: {after_ms / before_ms:.2f}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
