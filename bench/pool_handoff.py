"""What handing a photo to a pool process costs the worker: the pool's pipe against shared memory.

    .venv/bin/python bench/pool_handoff.py [--jobs 4000] [--bytes 110000] [--rounds 3]

The pool sends each process its tasks through a multiprocessing queue: the queue's feeder
thread pickles a chunk of PreprocTasks, payloads included, into the process's pipe. The
other way would copy each payload into a shared-memory block and send the task without
it. Both run here with the pool's own PreprocTask and chunks of 4, against one spawned
process that reads every payload (its bytes, as a handler gets them); a photo's size by
default (the samples are 60-140 KB). Prints the worker side's CPU per job (this process,
the feeder thread included) for each, best of --rounds, and last their ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

from redbatch.preproc_worker.worker import PreprocTask

CHUNK = 4
RING = 64  # payloads the shared block holds at once


def _reader(tasks: Any, done: Connection, shm_name: str | None) -> None:
    block = shared_memory.SharedMemory(name=shm_name) if shm_name else None
    total = 0
    while (chunk := tasks.get()) is not None:
        for task in chunk:
            if block is None:
                total += len(task.payload)
            else:
                start, size = task.params["at"], task.params["size"]
                total += len(bytes(block.buf[start:start + size]))
    done.send(total)
    if block is not None:
        block.close()


def _round(ctx: Any, mode: str, jobs: int, payload: bytes) -> float:
    """The worker side's CPU µs a job for one run of ``jobs`` hand-offs."""
    tasks, (done_r, done_w) = ctx.Queue(), ctx.Pipe(duplex=False)
    block = shared_memory.SharedMemory(create=True, size=len(payload) * RING) \
        if mode == "shared memory" else None
    proc = ctx.Process(target=_reader, args=(tasks, done_w, block.name if block else None))
    proc.start()
    tasks.put([])  # the process is up and reading
    time.sleep(1.0)
    size = len(payload)
    cpu = time.process_time()
    for first in range(0, jobs, CHUNK):
        chunk = []
        for key in range(first, first + CHUNK):
            if block is None:
                chunk.append(PreprocTask(key, key % RING, payload, "image/jpeg"))
            else:
                at = (key % RING) * size
                block.buf[at:at + size] = payload
                chunk.append(PreprocTask(key, key % RING, b"", "image/jpeg",
                                         {"at": at, "size": size}))
        tasks.put(chunk)
        if first % (RING // 2) == 0:
            time.sleep(0.002)  # let the reader keep up, so the ring is never overwritten
    tasks.put(None)
    assert done_r.recv() == jobs * size
    used = time.process_time() - cpu
    proc.join()
    tasks.close()
    tasks.join_thread()
    if block is not None:
        block.close()
        block.unlink()
    return used / jobs * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--bytes", type=int, default=110_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    payload = os.urandom(args.bytes)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for mode in ("pipe", "shared memory"):
            usec = _round(ctx, mode, args.jobs, payload)
            best[mode] = min(best.get(mode, usec), usec)
            print(f"{mode:<14} {usec:6.1f} µs of the worker's CPU a job")
    print(f"best: pipe {best['pipe']:.1f} µs, shared memory {best['shared memory']:.1f} µs "
          f"a {args.bytes:,}-byte payload; load {os.getloadavg()[0]:.1f}")
    print(f"RATIO shared memory / pipe = {best['shared memory'] / best['pipe']:.2f}")


if __name__ == "__main__":
    main()
