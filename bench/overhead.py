"""What the framework costs: null-model jobs/s through redbatch / the raw Redis round-trip rate.

    .venv/bin/python bench/overhead.py [--seconds 10] [--window 256] [--batch 64]
                                       [--payload tiny|photo|tensor] [--repeat 1]

Both sides run in one run against one private redis-server, under the same closed loop
(bench/harness.py ``closed_loop``): the client process keeps ``--window`` jobs in flight and
submits a new job as each one finishes; a consumer in another process answers them in
batches of up to ``--batch``; the client learns of finished jobs by popping one reply list
and reads each result with GET (pipelined). Only the consumer side differs:

* **raw Redis round trip**: the least Redis work that moves a job and its answer.
  Client: ``XADD`` (pipelined) of the very fields redbatch puts on its stream (``rid`` and
  the msgpack job envelope holding the payload); consumer (a plain redis-py loop in its own
  process): ``XREADGROUP COUNT batch`` then one pipeline of ``SET result PX`` (a blob the
  size of a null-model result), ``RPUSH reply rid``, ``XACK``, ``XDEL``; client: ``LPOP``
  the reply list and ``GET`` the result. No decoding, no model, no admission script.
* **redbatch**: ``redbatch worker --model null --calibrate off --max-batch-size batch
  --max-inflight window``
  and the real client (``Client.submit_jobs``: the admission script, ``reply_to``). The null
  model decodes the payload and takes the mean colour of a 32x32 thumbnail, so what is
  measured is redbatch itself: intake, the preprocessing pool and shared memory, the
  batcher, the model thread, the result writer, heartbeats and metrics.

The raw rate is measured before and after redbatch and averaged (the machine is shared).
``--repeat N`` interleaves N rounds (raw, redbatch, raw, redbatch, ..., raw): each round's
ratio is against the raw runs either side of it, and the median round is reported.
For reference a third raw run goes unpipelined: one XADD per job, one job per XREADGROUP,
one command per round trip on the consumer side (the client still collects as above); the
ratio against it is printed too, but the target is against the pipelined loop.
``--payload tiny`` (default) sends 32x32 JPEGs (~1 kB, decode ~0.1 ms); ``photo`` sends the
sample photos (39-113 kB), where decoding a photo dominates; ``tensor`` sends four float32
values (16 B) to ``--model null_tensor``, whose preprocessing is a copy run inline by the
worker (no pool process): redbatch's own path with no decoding at all, the closest to what
the raw loop does.

Prints both rates, the worker's batch sizes and the ratio last (issue 6 target >= 0.5).
Writes bench/out/overhead.csv and bench/out/overhead.png (``overhead-PAYLOAD.*`` for a
payload other than ``tiny``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import cast

import redis
from harness import (
    ClosedRun,
    Finished,
    RedbatchTarget,
    RssSampler,
    closed_loop,
    fmt,
    latency_summary,
    machine_load,
    payloads_for,
    photos,
    plot_rates,
    reexec_with_worker_malloc,
    start_worker,
    verdict,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import ResultEnvelope, Status
from redbatch.common.redis_io import StreamEntry
from redbatch.producer.client import Client
from redis.client import Pipeline

#: The model each payload goes to.
MODELS = {"tiny": "null", "photo": "null", "tensor": "null_tensor"}
TARGET = 0.5
RAW_STREAM = "rawbench:jobs"
RAW_GROUP = "workers"
RAW_REPLY = "rawbench:reply"
RESULT_TTL_MS = 600_000


def result_blob() -> bytes:
    """A result envelope the size of the null model's."""
    return ResultEnvelope("x" * 32, Status.OK, output={"mean_rgb": [0.1234, 0.5678, 0.9012]},
                          timings={k: 12.345 for k in ("queue_ms", "preprocess_ms",
                                                       "batch_wait_ms", "inference_ms",
                                                       "total_ms")},
                          batch_size=64, worker="host-12345-abcdef", model="null",
                          finished_ms=int(time.time() * 1000)).encode()


class RawTarget:
    """The client half of the raw round trip: XADD of redbatch's own job fields."""

    reply_key = RAW_REPLY

    def __init__(self, url: str, model: str, payloads: Sequence[bytes],
                 pipelined: bool = True) -> None:
        self.r = redis.Redis.from_url(url)
        self.maker = Client(url, model=model)  # only to build envelopes, byte for byte
        self._payloads = itertools.cycle(payloads)
        self.pipelined = pipelined

    def submit(self, n: int) -> list[str]:
        pipe = self.r.pipeline(transaction=False) if self.pipelined else self.r
        rids = []
        for _ in range(n):
            job = self.maker.job(next(self._payloads))
            pipe.xadd(RAW_STREAM, job.encode())  # type: ignore[arg-type]
            rids.append(job.request_id)
        if isinstance(pipe, Pipeline):  # a plain client already ran each command
            pipe.execute()
        return rids

    def result_key(self, rid: str) -> str:
        return f"rawbench:result:{rid}"

    def decode(self, rid: str, data: bytes | None, seen_at: float) -> Finished:
        return Finished(rid, seen_at, data is not None, 0, float("nan"), float("nan"))

    def close(self) -> None:
        self.r.close()
        self.maker.close()


def raw_consumer(url: str, batch: int, pipelined: bool) -> None:
    """The consumer half: XREADGROUP, then SET + RPUSH + XACK + XDEL in one pipeline (or, not
    pipelined, one job per XREADGROUP and one command per round trip)."""
    r = redis.Redis.from_url(url)
    blob = result_blob()
    name = f"raw-{os.getpid()}"
    while True:
        # RESP2's reply shape; redis-py types it as the union of its RESP2 and RESP3 shapes.
        got = cast(list[tuple[bytes, list[StreamEntry]]],
                   r.xreadgroup(RAW_GROUP, name, {RAW_STREAM: ">"},
                                count=batch if pipelined else 1, block=100))
        if not got:
            continue
        entries = got[0][1]
        pipe = r.pipeline(transaction=False) if pipelined else r
        for _, fields in entries:
            rid = fields[b"rid"].decode()
            pipe.set(f"rawbench:result:{rid}", blob, px=RESULT_TTL_MS)
            pipe.rpush(RAW_REPLY, rid)
        ids = [entry_id for entry_id, _ in entries]
        pipe.xack(RAW_STREAM, RAW_GROUP, *ids)
        pipe.xdel(RAW_STREAM, *ids)
        if isinstance(pipe, Pipeline):
            pipe.execute()


def raw_phase(url: str, payloads: Sequence[bytes], args: argparse.Namespace,
              pipelined: bool = True) -> ClosedRun:
    r = redis.Redis.from_url(url)
    r.delete(RAW_STREAM, RAW_REPLY)
    r.xgroup_create(RAW_STREAM, RAW_GROUP, id="0", mkstream=True)
    consumer = subprocess.Popen([sys.executable, __file__, "--raw-consumer", url,
                                 "--batch", str(args.batch),
                                 *([] if pipelined else ["--unpipelined"])],
                                stdin=subprocess.DEVNULL)
    target = RawTarget(url, MODELS[args.payload], payloads, pipelined)
    try:
        return closed_loop(url, target, args.window, args.seconds, warmup_s=args.warmup_s)
    finally:
        target.close()
        consumer.terminate()
        consumer.wait()
        r.xgroup_destroy(RAW_STREAM, RAW_GROUP)
        r.close()


def redbatch_phase(url: str, payloads: Sequence[bytes],
                   args: argparse.Namespace) -> tuple[ClosedRun, int]:
    """The closed loop through a null-model worker; also the worker's peak RSS (with pool)."""
    # Nothing to calibrate in a model that does no work.
    model = MODELS[args.payload]
    worker = start_worker(url, model, ["--model", model, "--calibrate", "off",
                                       "--max-batch-size", str(args.batch), "--max-inflight",
                                       str(args.window), *shlex.split(args.worker_args)],
                          "overhead-worker.log")
    try:
        target = RedbatchTarget(url, model, payloads)
        with RssSampler(worker.pid) as rss:
            run = closed_loop(url, target, args.window, args.seconds, warmup_s=args.warmup_s)
        target.close()
        return run, rss.peak
    finally:
        worker.stop()


def out_name(payload: str, ext: str) -> str:
    """The output file of a run with ``payload``: overhead.EXT for the default."""
    return f"overhead.{ext}" if payload == "tiny" else f"overhead-{payload}.{ext}"


def draw(rates: dict[str, float], title: str, payload: str) -> None:
    plot_rates(out_name(payload, "png"), rates, title, "jobs / s", "%.0f", 3.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="steady phase of each run")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window", type=int, default=256, help="jobs in flight")
    parser.add_argument("--batch", type=int, default=64, help="consumer batch / max batch size")
    parser.add_argument("--payload", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of raw + redbatch, interleaved; the median ratio counts")
    parser.add_argument("--raw-consumer", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--unpipelined", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_consumer:
        raw_consumer(args.raw_consumer, args.batch, not args.unpipelined)
        return
    reexec_with_worker_malloc()
    payloads = photos() if args.payload == "photo" else payloads_for(MODELS[args.payload])
    raws: list[ClosedRun] = []
    rounds: list[ClosedRun] = []
    peak = 0
    with RedisServer() as server:
        for _ in range(max(1, args.repeat)):
            raws.append(raw_phase(server.url, payloads, args))
            ours, round_peak = redbatch_phase(server.url, payloads, args)
            rounds.append(ours)
            peak = max(peak, round_peak)
        raws.append(raw_phase(server.url, payloads, args))
        raw_single = raw_phase(server.url, payloads, args, pipelined=False)
    report(args, payloads, raws, rounds, raw_single, peak)


def report(args: argparse.Namespace, payloads: Sequence[bytes], raws: list[ClosedRun],
           rounds: list[ClosedRun], raw_single: ClosedRun, peak: int) -> None:
    """Each round's ratio is its redbatch rate over the mean of the raw runs either side of
    it; the round with the median ratio is shown in full (with --repeat 1, the only one)."""
    ratios = [ours.throughput / ((raws[i].throughput + raws[i + 1].throughput) / 2)
              for i, ours in enumerate(rounds)]
    m = sorted(range(len(rounds)), key=ratios.__getitem__)[len(rounds) // 2]
    raw_before, ours, raw_after = raws[m], rounds[m], raws[m + 1]
    raw = (raw_before.throughput + raw_after.throughput) / 2
    ratio = ratios[m]
    runs = {"raw Redis (before)": raw_before, "redbatch null model": ours,
            "raw Redis (after)": raw_after, "raw Redis, unpipelined": raw_single}
    rows = []
    for name, run in runs.items():
        lat = latency_summary(run.latencies())
        rows.append([name, len(run.steady), fmt(run.steady_s), fmt(run.throughput),
                     *(fmt(lat[k]) for k in ("p50", "p99")), run.failed])
    write_csv(out_name(args.payload, "csv"),
              ["run", "jobs", "seconds", "jobs_per_s", "p50_ms", "p99_ms", "failed"], rows)
    sizes = Counter(c.finished.batch_size for c in ours.steady)
    mean_payload = sum(len(p) for p in payloads) / len(payloads)
    draw({n: r.throughput for n, r in runs.items()},
         f"null model vs raw Redis, window {args.window}, batch {args.batch}, "
         f"payload {args.payload} ({mean_payload / 1024:.1f} kB); {os.cpu_count()} cores",
         args.payload)
    print(f"cores={os.cpu_count()} window={args.window} batch={args.batch} "
          f"payload={args.payload} (mean {mean_payload:.0f} B) seconds={args.seconds} "
          f"worker_args={args.worker_args!r}")
    for name, run in runs.items():
        lat = latency_summary(run.latencies())
        print(f"{name:22s} {run.throughput:8.1f} jobs/s  ({len(run.steady)} jobs in "
              f"{run.steady_s:.0f} s; p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms; "
              f"failed {run.failed})")
    print(f"redbatch batch sizes (jobs by size): {dict(sorted(sizes.items()))}; "
          f"worker peak RSS with pool {peak / 2**20:.0f} MiB")
    print(machine_load())
    print(f"wrote bench/out/{out_name(args.payload, 'csv')}, "
          f"bench/out/{out_name(args.payload, 'png')}")
    print(f"for reference, against the unpipelined raw loop: {ours.throughput:.0f} / "
          f"{raw_single.throughput:.0f} = {ours.throughput / raw_single.throughput:.2f}")
    if len(rounds) > 1:
        print(f"ratio of each round, in order: {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"shown above and below: the median round ({m + 1} of {len(rounds)})")
    print(f"RATIO redbatch null-model / raw Redis round trip = {ours.throughput:.0f} / "
          f"{raw:.0f} = {ratio:.2f}  (target >= {TARGET}: {verdict(ratio, TARGET)})")


if __name__ == "__main__":
    main()
