"""Bounded memory at scale: `redbatch score` over 100k small images, memory sampled every second.

    .venv/bin/python bench/scale.py [--images 100000] [--cache bench/out/scale-images]

1. generates N tiny JPEGs (32x32, a few hundred distinct colours, encoded once and written
   repeatedly) into the cache folder, 1000 per subfolder; reused when it already holds N;
2. starts a private redis-server and one `redbatch worker --model null` (the built-in model
   that costs nearly nothing, so the run measures redbatch itself, not a network);
3. runs `redbatch score FOLDER -o bench/out/scale-output.jsonl --window 256` as a subprocess;
4. every second samples Redis INFO used_memory, DBSIZE, XLEN of the bulk stream, the worker's
   RSS (its own process, and separately the sum of its children: the pool processes), the
   scorer's RSS and progress (lines in the output file).

Prints the three memory figures at start (first sample past 1% done), middle (50%) and end
(last sample before the scorer exited), the total time and throughput, what is left in Redis
after the run, and checks that the output holds exactly N records. Writes every sample to
bench/out/scale.csv (and bench/out/scale.png when matplotlib is installed). The worker and
Redis are stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from types import FrameType

import psutil
import redis
from PIL import Image, ImageDraw
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import Keys, Lane

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MODEL = "null"
PER_FOLDER = 1000
DISTINCT = 300
#: Marks a folder as this script's cache, so only such a folder is ever wiped.
MARKER = ".redbatch-scale-images"
MIB = 1024 * 1024
WORKER_ARGS = ["--model", MODEL, "--log-level", "WARNING", "--max-batch-size", "64",
               "--max-inflight", "256"]


# ---------------------------------------------------------------------------- images


def distinct_jpegs(n: int, size: int = 32) -> list[bytes]:
    """``n`` different small JPEGs: a base colour, a second-colour rectangle, some noise."""
    rng = random.Random(1234)
    out = []
    for _ in range(n):
        img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        x0, y0 = rng.randrange(size // 2), rng.randrange(size // 2)
        draw.rectangle((x0, y0, x0 + rng.randrange(4, size // 2), y0 + rng.randrange(4, size // 2)),
                       fill=tuple(rng.randrange(256) for _ in range(3)))
        for _ in range(20):
            img.putpixel((rng.randrange(size), rng.randrange(size)),
                         tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def count_images(folder: Path) -> int:
    n = 0
    for sub in os.scandir(folder):
        if sub.is_dir():
            n += sum(1 for e in os.scandir(sub.path) if e.name.endswith(".jpg"))
        elif sub.name.endswith(".jpg"):
            n += 1
    return n


def ensure_images(folder: Path, n: int) -> tuple[bool, float]:
    """Make ``folder`` hold exactly ``n`` images; returns (generated, seconds)."""
    start = time.perf_counter()
    if folder.exists() and (folder / MARKER).exists() and count_images(folder) == n:
        return False, time.perf_counter() - start
    if folder.exists() and any(folder.iterdir()):
        if not (folder / MARKER).exists():
            raise SystemExit(f"{folder} is not empty and not an image cache of this script; "
                             "pick another --cache")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(f"{n}\n")
    payloads = distinct_jpegs(DISTINCT)
    for i in range(n):
        sub = folder / f"{i // PER_FOLDER:04d}"
        if i % PER_FOLDER == 0:
            sub.mkdir(exist_ok=True)
        (sub / f"{i:07d}.jpg").write_bytes(payloads[(i * 7919) % DISTINCT])
    return True, time.perf_counter() - start


# ---------------------------------------------------------------------------- sampling


@dataclass(slots=True)
class Sample:
    t_s: float
    done: int
    redis_used: int
    redis_rss: int
    redis_keys: int
    bulk_xlen: int
    worker_rss: int
    pool_rss: int
    pool_procs: int
    scorer_rss: int
    scorer_alive: int


def rss(pid: int) -> tuple[int, int, int]:
    """RSS of the process, the sum of its descendants' RSS, and how many there are."""
    try:
        proc = psutil.Process(pid)
        own = proc.memory_info().rss
        kids = proc.children(recursive=True)
    except psutil.Error:
        return 0, 0, 0
    total = 0
    for kid in kids:
        try:
            total += kid.memory_info().rss
        except psutil.Error:
            pass
    return own, total, len(kids)


class LineCounter:
    """Lines in a file that only grows, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while chunk := f.read(1 << 20):
                    self.lines += chunk.count(b"\n")
                    self.offset += len(chunk)
        except FileNotFoundError:
            pass
        return self.lines


def sample(t0: float, r: redis.Redis, stream: str, lines: LineCounter, worker_pid: int,
           scorer: subprocess.Popen[bytes]) -> Sample:
    info = r.info("memory")
    worker_rss, pool_rss, pool_n = rss(worker_pid)
    scorer_rss, scorer_kids, _ = rss(scorer.pid)
    return Sample(t_s=round(time.monotonic() - t0, 2), done=lines.count(),
                  redis_used=int(info["used_memory"]), redis_rss=int(info["used_memory_rss"]),
                  redis_keys=int(r.dbsize()), bulk_xlen=int(r.xlen(stream)),
                  worker_rss=worker_rss, pool_rss=pool_rss, pool_procs=pool_n,
                  scorer_rss=scorer_rss + scorer_kids, scorer_alive=int(scorer.poll() is None))


def stop_scorer(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (it drains for its grace period), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(folder: Path, n: int, window: int, samples: list[Sample]) -> dict[str, object]:
    """Score ``folder`` once, appending a sample a second to ``samples``; what is left after."""
    keys = Keys(MODEL)
    stream = keys.stream(Lane.BULK)
    output = OUT / "scale-output.jsonl"
    with RedisServer() as server, open(OUT / "scale-worker.log", "wb") as wlog:
        worker = spawn_worker(server.url, WORKER_ARGS, stdout=wlog, stderr=subprocess.STDOUT)
        scorer: subprocess.Popen[bytes] | None = None
        r = redis.Redis.from_url(server.url)
        try:
            wait_worker_ready(server.url, keys, worker)
            cmd = [sys.executable, "-m", "redbatch.cli", "score", str(folder), "-o",
                   str(output), "--overwrite", "--redis", server.url, "--model", MODEL,
                   "--window", str(window)]
            # Gone before the scorer starts, so an older output is never counted as progress.
            output.unlink(missing_ok=True)
            lines = LineCounter(output)
            with open(OUT / "scale-score.out", "wb") as so, \
                    open(OUT / "scale-score.err", "wb") as se:
                t0 = time.monotonic()
                # Its own session: we stop it before the worker and Redis, in that order.
                scorer = subprocess.Popen(cmd, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
                samples.append(sample(t0, r, stream, lines, worker.pid, scorer))
                last_report = t0
                while scorer.poll() is None:
                    try:  # wait for the next whole second, or for the scorer to exit
                        scorer.wait(timeout=max(0.0, 1.0 - (time.monotonic() - t0) % 1.0))
                    except subprocess.TimeoutExpired:
                        pass
                    samples.append(sample(t0, r, stream, lines, worker.pid, scorer))
                    if worker.poll() is not None:
                        raise RuntimeError(f"worker exited with code {worker.returncode}")
                    if time.monotonic() - last_report >= 30:
                        last_report = time.monotonic()
                        s = samples[-1]
                        print(f"  {s.t_s:7.0f}s  {s.done:>8}/{n}  redis {s.redis_used / MIB:6.1f}"
                              f" MiB  worker {s.worker_rss / MIB:6.1f}+{s.pool_rss / MIB:6.1f} "
                              f"MiB  scorer {s.scorer_rss / MIB:6.1f} MiB", flush=True)
                elapsed = time.monotonic() - t0
            info = r.info("memory")
            after: dict[str, object] = {
                "elapsed_s": elapsed,
                "exit_code": scorer.returncode,
                "redis_used": int(info["used_memory"]),
                "redis_keys": int(r.dbsize()),
                "bulk_xlen": int(r.xlen(stream)),
                "leftover_keys": sorted(k.decode() for k in r.scan_iter(count=1000))[:10],
                "worker_alive": worker.poll() is None,
                "output": output,
                "stream": stream,
            }
            # The sample after exit (scorer_alive 0) also counts lines written at the very end.
            samples.append(sample(t0, r, stream, lines, worker.pid, scorer))
        finally:
            if scorer is not None:
                stop_scorer(scorer)
            after_worker = stop_worker(worker)
            r.close()
    after["worker_exit_code"] = after_worker
    return after


# ---------------------------------------------------------------------------- report


def pick(samples: list[Sample], n: int) -> dict[str, Sample]:
    running = [s for s in samples if s.scorer_alive] or samples
    start = next((s for s in running if s.done >= 0.01 * n), running[0])
    middle = next((s for s in running if s.done >= 0.5 * n), running[-1])
    peak = Sample(*[max(getattr(s, f.name) for s in running) for f in fields(Sample)])
    return {"start": start, "middle": middle, "end": running[-1], "peak": peak}


def check_output(path: Path) -> tuple[int, Counter[str], int]:
    """Lines, outcomes (status or error code) and distinct ids of the output file."""
    outcomes: Counter[str] = Counter()
    ids = set()
    lines = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            lines += 1
            try:
                rec = json.loads(line)
            except ValueError:
                outcomes["unparseable"] += 1
                continue
            ids.add(rec.get("id"))
            outcomes[rec["status"] if rec.get("status") == "ok"
                     else (rec.get("error") or {}).get("code", "?")] += 1
    return lines, outcomes, len(ids)


def write_csv(samples: list[Sample]) -> Path:
    path = OUT / "scale.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([fl.name for fl in fields(Sample)])
        w.writerows(astuple(s) for s in samples)
    return path


def plot(samples: list[Sample], n: int) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    x = [s.done for s in samples]
    fig, ax = plt.subplots(figsize=(9, 5))
    for attr, label in [("redis_used", "Redis used_memory"), ("worker_rss", "worker RSS"),
                        ("pool_rss", "pool processes RSS (sum)"), ("scorer_rss", "scorer RSS")]:
        ax.plot(x, [getattr(s, attr) / MIB for s in samples], label=label)
    ax.set_xlabel(f"images scored (of {n})")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title("redbatch score: memory vs progress")
    ax.legend()
    ax.grid(alpha=0.3)
    path = OUT / "scale.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def mib(b: float) -> str:
    return f"{b / MIB:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--cache", type=Path, default=OUT / "scale-images",
                        help="folder of generated images, reused when it holds --images")
    parser.add_argument("--window", type=int, default=256, help="redbatch score --window")
    args = parser.parse_args()

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # so SIGTERM stops the scorer, worker and Redis too

    signal.signal(signal.SIGTERM, on_term)
    OUT.mkdir(parents=True, exist_ok=True)
    n = args.images
    folder = args.cache.resolve()
    generated, gen_s = ensure_images(folder, n)
    print(f"{'generated' if generated else 'reusing'} {n} images in {folder} ({gen_s:.1f}s)",
          flush=True)

    samples: list[Sample] = []
    try:
        after = run(folder, n, args.window, samples)
    except KeyboardInterrupt:
        print(f"interrupted; scorer, worker and Redis stopped; {len(samples)} samples in "
              f"{write_csv(samples)}", file=sys.stderr)
        sys.exit(130)
    csv_path = write_csv(samples)
    png = plot(samples, n)
    lines, outcomes, distinct = check_output(Path(str(after["output"])))
    picked = pick(samples, n)
    elapsed = float(str(after["elapsed_s"]))
    first, end = picked["start"], picked["end"]
    steady = ((end.done - first.done) / (end.t_s - first.t_s)) if end.t_s > first.t_s else 0.0

    print(f"cores={os.cpu_count()} images={n} window={args.window} "
          f"worker_args={' '.join(WORKER_ARGS)!r}")
    print(f"samples: {csv_path} ({len(samples)} rows)" + (f", plot: {png}" if png else ""))
    print(f"{'':8}{'t_s':>8}{'done':>9}  {'redis used':>10}  {'worker':>8}  "
          f"{'pool (n)':>12}  {'scorer':>8}  {'redis keys':>10}  {'bulk XLEN':>9}   (MiB)")
    for name, s in picked.items():
        when = f"{'(max)':>17}" if name == "peak" else f"{s.t_s:8.0f}{s.done:9d}"
        print(f"{name:8}{when}  {mib(s.redis_used):>10}  {mib(s.worker_rss)}  "
              f"{mib(s.pool_rss)} ({s.pool_procs:d})  {mib(s.scorer_rss)}  {s.redis_keys:10d}  "
              f"{s.bulk_xlen:9d}")
    start, middle = picked["start"], picked["middle"]
    for attr in ("redis_used", "worker_rss", "pool_rss", "scorer_rss"):
        a, b, c = getattr(start, attr), getattr(middle, attr), getattr(end, attr)
        print(f"growth {attr:11} start->middle {(b - a) / MIB:+7.1f} MiB   middle->end "
              f"{(c - b) / MIB:+7.1f} MiB   start->end {(c - a) / MIB:+7.1f} MiB "
              f"({(c - a) / a * 100 if a else 0:+.1f}%)")
    print(f"total {elapsed:.1f}s  throughput {n / elapsed:.1f} img/s overall, "
          f"{steady:.1f} img/s between the 1% sample and the end")
    print(f"scorer exit code {after['exit_code']}, worker exit code {after['worker_exit_code']}")
    print(f"after the run: Redis used_memory {after['redis_used']} B "
          f"({int(str(after['redis_used'])) / MIB:.1f} MiB), DBSIZE {after['redis_keys']}, "
          f"XLEN {after['stream']} = {after['bulk_xlen']}")
    if after["leftover_keys"]:
        print(f"keys left (first 10): {after['leftover_keys']}")
    ok = lines == n and distinct == n and outcomes.get("ok", 0) == n
    print(f"output {after['output']}: {lines} lines, {distinct} distinct ids, "
          f"outcomes {dict(outcomes)} -> {'OK' if ok else 'MISMATCH'} (expected {n})")
    print("MEMORY start/middle/end (MiB): "
          + "  ".join(f"{label} {getattr(start, a) / MIB:.1f}/{getattr(middle, a) / MIB:.1f}/"
                      f"{getattr(end, a) / MIB:.1f}"
                      for label, a in [("redis_used", "redis_used"), ("worker", "worker_rss"),
                                       ("pool", "pool_rss"), ("scorer", "scorer_rss")]))
    if not ok or after["exit_code"] != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
