"""The worker's malloc settings keep a forward pass in the model thread free of page faults,
and its preprocessing processes give a huge image's memory back."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import zlib

import psutil
import pytest
from conftest import SAMPLES, WorkerFactory
from redbatch.gpu_worker.device import malloc_tuning
from redbatch.producer.client import Client

# Batch 16 of the default model in a thread that is not the main one, as the worker's model
# thread runs it; prints the fewest page faults of three passes after a first one (the
# fewest: the kernel may reclaim idle pages now and then, which faults whatever malloc does).
FORWARD_IN_A_THREAD = """
import resource, threading, torch
from redbatch.handlers.efficientnet_lite import load_efficientnet_lite0
torch.set_num_threads(1)
model, x, faults = load_efficientnet_lite0(), torch.zeros(16, 3, 224, 224), []
def forward():
    with torch.inference_mode():
        model(x)
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            model(x)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=forward)
thread.start()
thread.join()
print(min(faults))
"""


def faults_per_forward(env: dict[str, str]) -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", FORWARD_IN_A_THREAD], env={**base, **env},
                          capture_output=True, text=True, timeout=300, check=True)
    return int(proc.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
@pytest.mark.full
def test_one_arena_is_what_removes_the_faults_in_the_model_thread() -> None:
    # A 77 MB activation does not fit a thread arena's 64 MiB heap: without one arena it
    # is mapped and unmapped on every pass, whatever the thresholds.
    thresholds_only = {k: v for k, v in malloc_tuning.MALLOC_ENV.items()
                       if k != "MALLOC_ARENA_MAX"}
    assert faults_per_forward(thresholds_only) > 50_000
    assert faults_per_forward(malloc_tuning.MALLOC_ENV) < 5_000


def solid_rgba_png(width: int, height: int) -> bytes:
    """A PNG of one colour with an alpha channel, compressed row by row: 8000 x 8000 is
    256 MB of pixels in about 260 KB, made without holding the pixels in memory."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    row = b"\x00" + bytes((200, 120, 40, 128)) * width  # filter byte, then RGBA pixels
    deflate = zlib.compressobj(9)
    idat = b"".join([deflate.compress(row) for _ in range(height)] + [deflate.flush()])
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


def _status_mib(pid: int, field: str) -> float:
    """A memory line of /proc/PID/status (VmRSS, VmHWM: the peak), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
@pytest.mark.full
def test_a_huge_png_leaves_the_pool_small_and_the_worker_tuned(
        redis_url: str, start_worker: WorkerFactory) -> None:
    # Within the 64 M-pixel limit, 1.2 GiB at the peak of its decoding. The pool process
    # inherits the worker's MALLOC_* (glibc then keeps every freed byte), so what brings it
    # back down is the trim after the task.
    png = solid_rgba_png(8000, 8000)
    assert len(png) < 400_000
    worker = start_worker("--pool-processes", "1")
    pool = [p for p in psutil.Process(worker.pid).children()
            if "spawn_main" in " ".join(p.cmdline())]
    assert len(pool) == 1
    for proc in (psutil.Process(worker.pid), pool[0]):
        env = proc.environ()
        assert {k: env.get(k) for k in malloc_tuning.MALLOC_ENV} == malloc_tuning.MALLOC_ENV
    with Client(redis_url) as client:
        assert client.predict(png, timeout_s=120).ok
        answered = time.monotonic()
        assert _status_mib(pool[0].pid, "VmHWM") > 1000, "the PNG was decoded at full size"
        while (rss := _status_mib(pool[0].pid, "VmRSS")) >= 300:
            assert time.monotonic() - answered < 10, f"pool process still at {rss:.0f} MiB"
            time.sleep(0.1)
        assert client.predict((SAMPLES / "cat.jpg").read_bytes(), timeout_s=60).ok
    # The same process all along: its memory came back, it was not replaced.
    assert pool[0].is_running() and pool[0].pid in [p.pid for p in
                                                    psutil.Process(worker.pid).children()]
