"""Does the pool keep its processes fed? Decoding that takes as long as a photo's on the
GPU box, with little CPU, so that the refill (records back, more tasks out) decides.

    .venv/bin/python bench/pool_refill.py [--processes 4] [--prefetch-ms 5] [--rounds 2]

The worker serves ``pool_refill:factory``: the null model whose preprocessing first sleeps
DECODE_S (2.2 ms, a sample photo's decode on the first H200 run's cores), on tiny JPEGs,
so N processes could answer about N / (DECODE_S + their decode) jobs a second while
using little of this machine's two cores. A closed loop keeps 256 jobs in flight. Prints
jobs/s per round and last the ratio to that ideal: what is missing is processes idling
while the pool holds work for them (preproc_worker/pool.py ``_Pace``).

The same handler carries photos without decoding them (past PHOTO_BYTES it only waits), so
the worker's own CPU for photo-sized payloads can be read at GPU-like rates here:

    PYTHONPATH=bench .venv/bin/python bench/cpu_budget.py --model pool_refill:factory \
        --worker-args "--pool-processes 8" [--record]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from harness import RedbatchTarget, closed_loop, start_worker, tiny_jpegs
from redbatch.cli.local_stack import stop_worker
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import LimitSettings
from redbatch.handlers.imagenet import NullModel

#: The sleep before each decode, s: a sample photo's decode on the H200 box (2.2 ms).
DECODE_S = 0.0022
#: A tiny JPEG's decode here, s, for the ideal rate.
TINY_S = 0.0002
#: Payloads past this many bytes are photos, not decoded (bench/cpu_budget.py sends the
#: sample photos to this model: the hand-off of photo-sized payloads, without their decode).
PHOTO_BYTES = 16_384


class SleepyNull(NullModel):
    """The null model, its preprocessing DECODE_S longer (a wait, not CPU)."""

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        time.sleep(DECODE_S)
        if len(payload) > PHOTO_BYTES:  # a photo: its bytes travel, its decode is the wait
            out.fill(0)
            return
        super().preprocess(payload, content_type, params, out)


def factory(limits: LimitSettings) -> SleepyNull:
    """The handler the worker loads (``--model pool_refill:factory``)."""
    return SleepyNull(limits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--prefetch-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args()
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    ideal = args.processes / (DECODE_S + TINY_S)
    with RedisServer() as server:
        worker = start_worker(server.url, "sleepy", [
            "--model", "pool_refill:factory", "--model-name", "sleepy", "--device", "cpu",
            "--pool-processes", str(args.processes),
            "--pool-prefetch-ms", str(args.prefetch_ms)], "pool_refill.log")
        try:
            target = RedbatchTarget(server.url, "sleepy", tiny_jpegs(300))
            closed_loop(server.url, target, 256, 3.0)  # warm-up: the pace settles
            rates = []
            for i in range(args.rounds):
                rates.append(closed_loop(server.url, target, 256, args.seconds).throughput)
                print(f"round {i + 1}: {rates[-1]:.0f} jobs/s")
        finally:
            stop_worker(worker.proc)
    load = os.getloadavg()[0]
    print(f"{args.processes} processes, prefetch {args.prefetch_ms} ms, load {load:.1f}; "
          f"ideal {ideal:.0f} jobs/s")
    print(f"RATIO best round / ideal = {max(rates) / ideal:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
