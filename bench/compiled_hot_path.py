"""What compiling the worker's per-job Python with mypyc would save: a measured prototype.

    .venv/bin/python bench/compiled_hot_path.py [--rounds 7] [--groups 100] [--keep DIR]
        [--modules redbatch/gpu_worker/batching/batcher.py ...]

Issue 13 asks what would bring the worker's per-job Python cost down if Python alone cannot:
this measures one candidate, compiling the hot-path modules to C with mypyc, on the product's
own code, unchanged.

1. Build: the package's code (``__init__.py`` and its sub-packages, not tests/ or bench/) is
   copied into a temporary directory as a ``redbatch`` package, and mypyc compiles the chosen
   modules there (``--modules``; by default the envelopes and keys of the protocol, the
   request keys and the fleet's recent-result record that the write path uses per answer,
   and the worker's batcher, intake, results, outbox and capacity). The type check runs with
   ``follow_imports = silent``, torch, numpy, Pillow and prometheus_client skipped (they are
   never compiled). A module mypyc refuses is left out, reported with its first error, and
   the others are built again. Nothing is written into the repository: the build and its
   ``.so`` files stay in the temporary directory (``--keep DIR``: built in DIR and kept).
2. Run: the same microbenchmark in two fresh processes, one importing redbatch as installed
   (interpreted), one with PYTHONPATH naming the temporary directory first, so the compiled
   extension modules are imported; each prints the file every candidate module came from,
   and the compiled run is refused unless each compiled module is a ``.so`` from that build.
3. The microbenchmark, on groups of 64 jobs (the worker's default in-flight window), with no
   Redis server (a redis-py client that never connects), through the product's functions:

   * **intake**: 64 stream entries as XREADGROUP returns them (``rid``, ``adm`` and a
     msgpack ``job`` field written by ``JobEnvelope.encode``: an 800-byte payload, a
     deadline, a reply list) decoded and validated by ``Intake._decode`` into Jobs, with the
     rest of ``Intake._read``'s per-entry loop (the Redis calls and lease upkeep left out);
   * **batcher**: ``Batcher.add`` of the 64 Jobs, then ``pop_expired``, ``next_wakeup``,
     ``pop_ready`` (the clock injected: a full batch is due) and ``run_size``, as one main
     loop step does, with a seeded LatencyEstimator as its run-time model (max batch 64);
   * **answers**: ``ResultWriter.ran`` on the 64 Jobs with ImageNet-style top-5 outputs
     (the result envelopes' msgpack, and the Answers);
   * **queue**: the write transaction's commands for the 64 answers, ``ResultWriter._queue``
     on a redis-py MULTI pipeline that is reset instead of executed (SET NX GET PX per
     result, one RPUSH and PEXPIRE for the reply list, the recent list, XACK, XDEL);
   * **bookkeeping**: ``Capacity`` taken and given back, ``Outbox.extend``, ``ship`` and
     ``settle`` of the write's outcome;
   * **total**: all five in order on each group, measured as one loop.

   Each part: one warm-up group, then ``--rounds`` rounds of ``--groups`` groups; CPU time
   (``time.process_time``) of the best round over the jobs it handled, µs per job. The
   garbage collector stays on, as in the worker (collected before each round).
4. The library floor of each part, measured the same way in both runs: its calls into
   msgpack and redis-py alone, with the arguments redbatch would have built ready (intake:
   ``msgpack.unpackb`` of the 64 job bodies with the envelope limits; answers: ``packb`` of
   the 64 result bodies; queue: the same redis-py pipeline calls, and the ``packb`` of the
   recent-list records). Compiling redbatch leaves that as it is: msgpack is C already and
   redis-py stays interpreted. The table shows the lower of the two runs' floors.

Prints the build, the files imported, the table (part, interpreted and compiled µs per job,
speed-up, floor) and the ratios last; writes bench/out/compiled_hot_path.csv and .png.
Other code stays interpreted in the compiled run too: the ``__init__`` the dataclasses module
generates for each (compiled) dataclass, and the Enum machinery of ``Lane`` and the codes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import redis
from harness import ROOT, machine_load, plot, write_csv
from redbatch.common.protocol import (
    FIELD_ADMITTED,
    FIELD_JOB,
    MAX_ARRAY_LEN,
    MAX_MAP_LEN,
    MAX_STR_BYTES,
    JobEnvelope,
    Keys,
    Lane,
)
from redbatch.common.protocol import GROUP as CONSUMER_GROUP
from redbatch.common.redis_io import StreamEntry
from redbatch.gpu_worker.batching.batcher import Batcher, LatencyEstimator
from redbatch.gpu_worker.batching.capacity import Capacity
from redbatch.gpu_worker.events import Written
from redbatch.gpu_worker.metrics import Health
from redbatch.gpu_worker.outbox import Outbox
from redbatch.gpu_worker.streams.intake import BadEntry, Intake, Job
from redbatch.gpu_worker.streams.results import Answer, Flushed, ResultWriter

GROUP = 64
"""Jobs per group: one intake read, one batch, one write."""
PAYLOAD_BYTES = 800
PARTS = ("intake", "batcher", "answers", "queue", "bookkeeping")
DEFAULT_MODULES = (
    "common/protocol/envelopes.py",
    "common/protocol/keys.py",
    "common/protocol/request_keys.py",
    "common/protocol/fleet.py",
    "gpu_worker/batching/batcher.py",
    "gpu_worker/streams/intake.py",
    "gpu_worker/streams/results.py",
    "gpu_worker/outbox.py",
    "gpu_worker/batching/capacity.py",
)
#: What the temporary package holds: the package's own code, as installed.
PACKAGE_PARTS = ("__init__.py", "py.typed", "cli", "common", "gpu_worker", "handlers",
                 "preproc_worker", "producer")
MYPY_INI = """\
[mypy]
ignore_missing_imports = True
follow_imports = silent
[mypy-torch.*,torchvision.*,numpy.*,PIL.*,prometheus_client.*]
follow_imports = skip
"""
ERROR_LINE = re.compile(r"^(redbatch/\S+\.py):(\d+): error: (.*)$", re.MULTILINE)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="rounds per part (the best counts)")
    p.add_argument("--groups", type=int, default=100, help="groups of 64 jobs per round")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="build in DIR and keep it (default: a temporary directory, removed)")
    p.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES),
                   help="modules to compile, as paths inside the package")
    p.add_argument("--child", choices=("interpreted", "compiled"), default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--expect-so", nargs="*", default=[], help=argparse.SUPPRESS)
    return p.parse_args()


def module_name(path: str) -> str:
    """``gpu_worker/streams/intake.py`` -> ``redbatch.gpu_worker.streams.intake``."""
    return "redbatch." + path.removesuffix(".py").replace("/", ".")


# ---------------------------------------------------------------------------- build


@dataclass(slots=True)
class Build:
    compiled: list[str]
    failed: dict[str, str]
    """Module path -> the first error mypyc gave for it."""
    seconds: float


def stage(build_dir: Path) -> None:
    """Copy the package's code to ``build_dir/redbatch`` (replacing an earlier copy)."""
    for old in ("redbatch", "build"):
        shutil.rmtree(build_dir / old, ignore_errors=True)
    package = build_dir / "redbatch"
    package.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in PACKAGE_PARTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, package / name, ignore=ignore)
        else:
            shutil.copy2(source, package / name)
    (build_dir / "mypy.ini").write_text(MYPY_INI)


def run_mypyc(build_dir: Path, modules: Sequence[str]) -> tuple[bool, str]:
    """mypyc (its command, which builds in place) on ``modules``; (succeeded, its output)."""
    cmd = [str(Path(sys.executable).with_name("mypyc")), "--config-file", "mypy.ini",
           *[f"redbatch/{m}" for m in modules]]
    done = subprocess.run(cmd, cwd=build_dir, capture_output=True, text=True)
    return done.returncode == 0, done.stdout + done.stderr


def compile_modules(build_dir: Path, modules: Sequence[str]) -> Build:
    """Compile ``modules`` together; those mypyc names in an error are left out and the rest
    built again. An error it pins on none of them: each is tried alone to find the culprit."""
    start = time.perf_counter()
    todo, failed = list(modules), {}
    while todo:
        ok, output = run_mypyc(build_dir, todo)
        if ok:
            break
        blamed = {path.removeprefix("redbatch/"): message
                  for path, _, message in reversed(ERROR_LINE.findall(output))}
        blamed = {m: why for m, why in blamed.items() if m in todo}
        if not blamed:
            tail = output.strip().splitlines()[-1:] or ["no output"]
            blamed = {m: tail[0] for m in todo if not run_mypyc(build_dir, [m])[0]} or \
                {m: tail[0] for m in todo}
        failed.update(blamed)
        todo = [m for m in todo if m not in blamed]
    return Build(todo, failed, time.perf_counter() - start)


# ---------------------------------------------------------------------------- child


def product_modules() -> list[str]:
    return [module_name(m) for m in DEFAULT_MODULES]


def imported_from() -> dict[str, str]:
    """Each candidate module's file, and mypyc's shared runtime library when loaded."""
    files = {name: str(getattr(sys.modules.get(name), "__file__", "not imported"))
             for name in product_modules()}
    files.update({name: str(getattr(mod, "__file__", "")) for name, mod in sys.modules.items()
                  if name.endswith("__mypyc")})
    return files


def best_us_per_job(run: Callable[[], object], groups: int, rounds: int) -> float:
    """µs of CPU per job of the best round of ``groups`` calls of ``run`` (one group each)."""
    run()
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        start = time.process_time()
        for _ in range(groups):
            run()
        best = min(best, time.process_time() - start)
    return best / (groups * GROUP) * 1e6


def top5_output(i: int) -> dict[str, Any]:
    """An output shaped like the ImageNet handlers' (handlers/imagenet.py ``_top_k``)."""
    top = [{"label": f"class {i % 1000 + k}", "class_id": i % 1000 + k,
            "score": round(0.9 / (k + 1), 6)} for k in range(5)]
    return {**top[0], "top5": top}


class HotPath:
    """One group's trip through the worker's per-job Python, part by part, on the product's
    objects around a redis-py client that never connects."""

    def __init__(self, no_reply_every: int = 0) -> None:
        """``no_reply_every`` N > 0: every Nth job names no reply list (it gets a done token);
        the timed group has none, as the Python client's jobs do."""
        # Port 1: should anything try to connect, it fails at once instead of finding a server.
        self.client = redis.Redis(connection_pool=redis.ConnectionPool(host="127.0.0.1", port=1))
        self.keys = keys = Keys("bench")
        self.stream = keys.stream(Lane.INTERACTIVE)
        self.intake = Intake(self.client, keys, "bench-worker-1", 20 * 1024 * 1024)
        self.writer = ResultWriter(self.client, keys, "bench-worker-1", ttl_s=600)
        self.now_ms = time.time() * 1000
        self.entries: list[tuple[str, StreamEntry]] = []
        for i in range(GROUP):
            env = JobEnvelope(f"req-{i:06d}", "bench", os.urandom(PAYLOAD_BYTES), "image/jpeg",
                              int(self.now_ms), int(self.now_ms) + 30_000, Lane.INTERACTIVE,
                              {}, None if no_reply_every and i % no_reply_every == 0
                              else keys.reply("client-1"))
            fields = {name.encode(): value for name, value in env.encode().items()}
            fields[FIELD_ADMITTED.encode()] = b"1"
            self.entries.append((self.stream, (f"{int(self.now_ms)}-{i}".encode(), fields)))
        self.outputs = [top5_output(i) for i in range(GROUP)]
        self.outcomes = [SimpleNamespace(output=o, error=None, message="") for o in self.outputs]
        self.waits = [3.0] * GROUP
        latency = LatencyEstimator()
        latency.seed({1: 0.002, 8: 0.006, 64: 0.03})
        self.batcher: Batcher[Job] = Batcher(GROUP, 0.005, latency)
        self.pipe = self.client.pipeline(transaction=True)
        self.capacity = Capacity(GROUP)
        self.sent: list[list[Answer]] = []
        self.outbox = Outbox(Health(), self.sent.append)

    def intake_part(self) -> list[Job]:
        """Intake._read's loop over the entries, without its Redis calls."""
        jobs: list[Job] = []
        bad: list[BadEntry] = []
        now_s = time.monotonic()
        for stream, entry in self.entries:
            item = self.intake._decode(stream, entry, self.now_ms, now_s, 1)
            if isinstance(item, Job):
                item.taken_over = False
                item.deliveries = 1
                jobs.append(item)
            else:
                bad.append(item)
        raw = {entry_id: fields for _, (entry_id, fields) in self.entries}
        assert not bad and len(raw) == GROUP
        return jobs

    def batcher_part(self, jobs: list[Job]) -> list[Job]:
        for job in jobs:
            self.batcher.add(job)
        now = jobs[-1].arrival_s + 0.001
        self.batcher.pop_expired(now)
        self.batcher.next_wakeup(now)
        batch = self.batcher.pop_ready(now)
        self.batcher.run_size(len(batch))
        assert len(batch) == GROUP
        return batch

    def answers_part(self, jobs: list[Job]) -> list[Answer]:
        """The answers to one batch, as the main loop makes them (``ResultWriter.ran``)."""
        return self.writer.ran(jobs, self.outcomes, self.waits, 12.5)

    def queue_part(self, answers: list[Answer]) -> None:
        self.pipe.multi()
        self.writer._queue(self.pipe, answers)
        self.pipe.reset()

    def bookkeeping_part(self, answers: list[Answer]) -> None:
        # Intake's thread takes the places and marks the bulk ones; the main loop ships
        # the answers, takes the write's outcome and gives the places back.
        self.capacity.give_back(GROUP - self.capacity.take_up_to(GROUP, 0.0))
        self.capacity.took_bulk(0)
        self.outbox.extend(answers)
        now = time.monotonic()
        self.outbox.ship(now)
        written, _ = self.outbox.settle(Written(self.sent.pop(), Flushed()), now)
        self.capacity.give_back(len(written), bulk=0)

    def total(self) -> None:
        answers = self.answers_part(self.batcher_part(self.intake_part()))
        self.queue_part(answers)
        self.bookkeeping_part(answers)

    def measure(self, groups: int, rounds: int) -> dict[str, float]:
        """µs per job of each part and of the whole."""
        jobs = self.intake_part()
        answers = self.answers_part(jobs)
        runs: dict[str, Callable[[], object]] = {
            "intake": self.intake_part,
            "batcher": lambda: self.batcher_part(jobs),
            "answers": lambda: self.answers_part(jobs),
            "queue": lambda: self.queue_part(answers),
            "bookkeeping": lambda: self.bookkeeping_part(answers),
            "total": self.total,
        }
        return {part: best_us_per_job(run, groups, rounds) for part, run in runs.items()}


class LibraryFloor:
    """The same work's calls into msgpack and redis-py alone, with the arguments redbatch
    would have built ready: what compiling redbatch leaves as it is."""

    def __init__(self, path: HotPath) -> None:
        self.pipe, self.stream = path.pipe, path.stream
        self.bodies = [fields[FIELD_JOB.encode()] for _, (_, fields) in path.entries]
        self.answers = path.answers_part(path.intake_part())
        self.results = [msgpack.unpackb(a.encoded) for a in self.answers]
        self.recent_bodies = [{"finished_ms": 0, "lane": "interactive", "outcome": "ok",
                               "total_ms": 1.0} for _ in self.answers]
        self.recent_records = [msgpack.packb(b, use_bin_type=True) for b in self.recent_bodies]
        self.result_keys = [path.keys.result(a.request_id or "") for a in self.answers]
        self.reply, self.recent = path.keys.reply("client-1"), path.keys.recent()
        self.ids = [a.entry_id for a in self.answers]
        self.request_ids = [a.request_id or "" for a in self.answers]

    def decode(self) -> None:
        for body in self.bodies:
            msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=MAX_STR_BYTES,
                            max_bin_len=len(body), max_array_len=MAX_ARRAY_LEN,
                            max_map_len=MAX_MAP_LEN)

    def encode(self) -> None:
        for result in self.results:
            msgpack.packb(result, use_bin_type=True)

    def queue(self) -> None:
        pipe = self.pipe
        pipe.multi()
        for key, answer, body in zip(self.result_keys, self.answers, self.recent_bodies,
                                     strict=True):
            pipe.set(key, answer.encoded, px=600_000, nx=True, get=True)
            msgpack.packb(body, use_bin_type=True)
        pipe.rpush(self.reply, *self.request_ids)
        pipe.pexpire(self.reply, 600_000)
        pipe.lpushx(self.recent, *self.recent_records)
        pipe.xack(self.stream, CONSUMER_GROUP, *self.ids)
        pipe.xdel(self.stream, *self.ids)
        pipe.reset()

    def measure(self, groups: int, rounds: int) -> dict[str, float]:
        """µs per job of each part's floor (none for the parts that call no library)."""
        runs = {"intake": self.decode, "answers": self.encode, "queue": self.queue}
        floor = {part: best_us_per_job(runs[part], groups, rounds) if part in runs else 0.0
                 for part in PARTS}
        floor["total"] = sum(floor.values())
        return floor


def child(kind: str, expect_so: Sequence[str], groups: int, rounds: int) -> None:
    """Measure, check where the modules came from, print one JSON line."""
    path = HotPath()
    result = path.measure(groups, rounds)
    floor = LibraryFloor(path).measure(groups, rounds)
    files = imported_from()
    # Compiled: each compiled module must be a .so; interpreted: every one a .py file.
    suffix, expected = (".so", expect_so) if kind == "compiled" else (".py", DEFAULT_MODULES)
    wrong = [m for m in expected if not files[module_name(m)].endswith(suffix)]
    if wrong:
        raise SystemExit(f"the {kind} run imported {wrong} from elsewhere: {files}")
    print("RESULT " + json.dumps({"us_per_job": result, "floor": floor, "files": files}))


def run_child(kind: str, args: argparse.Namespace, build_dir: Path,
              compiled: Sequence[str]) -> dict[str, Any]:
    env = dict(os.environ)
    if kind == "compiled":
        env["PYTHONPATH"] = os.pathsep.join(
            [str(build_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, __file__, "--child", kind, "--rounds", str(args.rounds),
           "--groups", str(args.groups), "--expect-so", *compiled]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {kind} run failed:\n{done.stdout}{done.stderr}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


# ---------------------------------------------------------------------------- report


def shown(path: str, build_dir: Path) -> str:
    """A file name relative to the repository or the build directory."""
    for base, label in ((build_dir, "<build>"), (ROOT, "<repo>")):
        if path.startswith(str(base) + os.sep):
            return f"{label}/{os.path.relpath(path, base)}"
    return path


def print_build(build: Build, build_dir: Path) -> None:
    print(f"\nmypyc build in {build_dir}: {build.seconds:.0f} s")
    print(f"compiled ({len(build.compiled)}): {', '.join(build.compiled) or 'none'}")
    if build.failed:
        print(f"not compiled ({len(build.failed)}):")
        for module, why in build.failed.items():
            print(f"  {module}: {why}")
    else:
        print("not compiled: none (every module asked for compiled)")


def print_files(runs: dict[str, dict[str, Any]], build_dir: Path) -> None:
    for kind, result in runs.items():
        print(f"\n{kind} run imported:")
        for name, path in result["files"].items():
            print(f"  {name:40s} {shown(path, build_dir)}")


def print_table(interp: dict[str, float], comp: dict[str, float],
                floor: dict[str, float]) -> None:
    print(f"\n{'part':12s} {'interpreted us/job':>19s} {'compiled us/job':>16s} "
          f"{'speed-up':>9s} {'library floor':>14s} {'share of total':>15s}")
    for part in (*PARTS, "total"):
        share = f"{interp[part] / interp['total']:15.2f}" if part != "total" else ""
        print(f"{part:12s} {interp[part]:19.2f} {comp[part]:16.2f} "
              f"{interp[part] / comp[part]:8.2f}x {floor[part]:14.2f} {share}")
    parts_i, parts_c = sum(interp[p] for p in PARTS), sum(comp[p] for p in PARTS)
    print(f"{'sum of parts':12s} {parts_i:19.2f} {parts_c:16.2f} {parts_i / parts_c:8.2f}x")
    print("library floor: the part's msgpack and redis-py calls alone (arguments ready), "
          "which compiling redbatch leaves as they are; the lower of the two runs")


def print_ratios(interp: dict[str, float], comp: dict[str, float],
                 floor: dict[str, float]) -> None:
    print()
    for part in PARTS:
        print(f"RATIO compiled / interpreted {part} CPU per job = {comp[part]:.2f} / "
              f"{interp[part]:.2f} = {comp[part] / interp[part]:.2f}")
    own_i, own_c = interp["total"] - floor["total"], comp["total"] - floor["total"]
    print(f"RATIO library floor / interpreted hot path CPU per job = {floor['total']:.2f} / "
          f"{interp['total']:.2f} = {floor['total'] / interp['total']:.2f}")
    print(f"RATIO compiled / interpreted hot path CPU per job above the floor = {own_c:.2f} / "
          f"{own_i:.2f} = {own_c / own_i:.2f}")
    print(f"RATIO compiled / interpreted hot path CPU per job = {comp['total']:.2f} / "
          f"{interp['total']:.2f} = {comp['total'] / interp['total']:.2f}")


def save(interp: dict[str, float], comp: dict[str, float], floor: dict[str, float],
         build: Build) -> list[Path]:
    rows: list[tuple[Any, ...]] = [
        (part, round(interp[part], 3), round(comp[part], 3), round(interp[part] / comp[part], 3),
         round(floor[part], 3), "") for part in (*PARTS, "total")]
    rows += [(f"compiled:{m}", "", "", "", "", "") for m in build.compiled]
    rows += [(f"failed:{m}", "", "", "", "", why) for m, why in build.failed.items()]
    header = ("part", "interpreted_us_per_job", "compiled_us_per_job", "speedup",
              "library_floor_us_per_job", "note")
    csv_path = write_csv("compiled_hot_path.csv", header, rows)
    return [csv_path,
            plot("compiled_hot_path.png", lambda plt: _figure(plt, interp, comp, floor))]


def _figure(plt: Any, interp: dict[str, float], comp: dict[str, float],
            floor: dict[str, float]) -> None:
    names = [*PARTS, "total"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    y = range(len(names))
    ax.barh([i - 0.2 for i in y], [interp[n] for n in names], 0.4, label="interpreted",
            color="gray")
    ax.barh([i + 0.2 for i in y], [comp[n] for n in names], 0.4, label="mypyc-compiled")
    ax.scatter([floor[n] for n in names], list(y), marker="|", s=400, color="black",
               label="library floor (msgpack, redis-py)", zorder=3)
    for i, n in enumerate(names):
        ax.text(comp[n], i + 0.2, f" {interp[n] / comp[n]:.2f}x", va="center", fontsize=8)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"CPU µs per job (groups of {GROUP}, best round; lower is better)")
    ax.legend()
    fig.suptitle(f"the worker's per-job Python, interpreted and mypyc-compiled; "
                 f"{machine_load()}", fontsize=9)


def main() -> None:
    args = parse_args()
    if args.child:
        child(args.child, args.expect_so, args.groups, args.rounds)
        return
    print(f"bench/compiled_hot_path.py: {machine_load()}")
    build_dir = args.keep.resolve() if args.keep else \
        Path(tempfile.mkdtemp(prefix="redbatch-mypyc-"))
    try:
        stage(build_dir)
        build = compile_modules(build_dir, args.modules)
        print_build(build, build_dir)
        if not build.compiled:
            raise SystemExit("nothing compiled: nothing to compare")
        runs = {kind: run_child(kind, args, build_dir, build.compiled)
                for kind in ("interpreted", "compiled")}
        print_files(runs, build_dir)
    finally:
        if args.keep is None:
            shutil.rmtree(build_dir, ignore_errors=True)
    interp, comp = runs["interpreted"]["us_per_job"], runs["compiled"]["us_per_job"]
    floor = {part: min(runs[kind]["floor"][part] for kind in runs) for part in interp}
    print_table(interp, comp, floor)
    print(f"\nwrote {', '.join(str(p) for p in save(interp, comp, floor, build))}")
    print_ratios(interp, comp, floor)


if __name__ == "__main__":
    main()
