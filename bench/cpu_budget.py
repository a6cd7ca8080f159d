"""Where the time goes: CPU milliseconds per job, by process and by worker thread, at saturation.

    .venv/bin/python bench/cpu_budget.py [--model efficientnet_lite0|null|null_tensor]
                                         [--seconds 15] [--window 64] [--record]
                                         [--worker-args "..."]

One private redis-server and one `redbatch worker` (as shipped, or --worker-args); a closed
loop keeps --window jobs in flight (photos; tiny JPEGs for the null model). Over the steady
phase it reads the CPU time (user + system) of the client (this process), redis-server, each
thread of the worker's main process (named from ``py-spy dump`` when py-spy is installed:
``redbatch-model``, ``redbatch-intake``, ``preproc-pump``, ``MainThread``...) and each pool
process, and divides by the jobs answered. CPU time is what a job costs whatever else runs
on the machine, so unlike rates it means something on a busy machine too.

--record also samples the Python work (threads holding the GIL) of the worker and its pool
processes with ``py-spy record --gil`` (100 Hz) into
bench/out/cpu_budget-MODEL.speedscope.json (open it in https://www.speedscope.app) and
prints the ten functions that hold the most samples.

Prints the table, the throughput the cores would allow if every part ran in parallel, and
last the share of a job's CPU that is neither the model nor decoding (the framework's).
Writes bench/out/cpu_budget-MODEL.csv and bench/out/cpu_budget-MODEL.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
from harness import (
    OUT,
    RedbatchTarget,
    closed_loop,
    fmt,
    machine_load,
    payloads_for,
    plot,
    reexec_with_worker_malloc,
    start_worker,
    write_csv,
)
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import model_name_from_spec

#: Threads whose CPU is the model's own work (forward pass, gather, postprocess).
MODEL_THREAD = "redbatch-model"
#: CPU lanes (--cpu-lanes): each runs forward passes on a thread of its own.
LANE_THREAD = "redbatch-lane"


def py_spy() -> str | None:
    """py-spy beside this interpreter (a virtualenv not on PATH), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from ``py-spy dump``; {} without py-spy."""
    spy = py_spy()
    if spy is None:
        return {}
    out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
    return {int(tid): name for tid, name in re.findall(r'Thread (\d+) \(\w+\): "([^"]+)"',
                                                       out.stdout)}


def cpu_of(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


def snapshot(procs: dict[str, psutil.Process], worker: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of every process, and of every thread of the worker."""
    out = {name: cpu_of(p) for name, p in procs.items()}
    try:
        for t in worker.threads():
            out[f"thread:{t.id}"] = t.user_time + t.system_time
    except psutil.Error:
        pass
    return out


def budget(before: dict[str, float], after: dict[str, float], jobs: int,
           names: dict[int, str]) -> dict[str, float]:
    """ms of CPU per job by part; worker threads merged by name, pool processes summed."""
    parts: defaultdict[str, float] = defaultdict(float)
    for key, end in after.items():
        ms = (end - before.get(key, 0.0)) * 1000 / max(jobs, 1)
        if key.startswith("thread:"):
            tid = int(key.split(":")[1])
            parts[f"worker thread {names.get(tid, tid)}"] += ms
        elif key.startswith("pool"):
            parts["pool processes (decode)"] += ms
        elif key != "worker":  # the worker's own total is the sum of its threads
            parts[key] += ms
    ranked = sorted(parts.items(), key=lambda kv: kv[1], reverse=True)  # as most_common()
    return {k: v for k, v in ranked if v >= 0.005}


def record(pid: int, seconds: float, name: str) -> subprocess.Popen[bytes] | None:
    spy = py_spy()
    if spy is None:
        print("NOTE: --record needs py-spy (pip install py-spy)")
        return None
    # --gil: only threads holding the GIL, i.e. Python work; waits drop out, and so does
    # native work that releases the GIL (the forward pass), which the CPU table covers.
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--subprocesses", "--gil",
                             "--rate", "100",
                             "--duration", str(int(seconds)), "--format", "speedscope",
                             "--output", str(OUT / f"cpu_budget-{name}.speedscope.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_functions(path: Path, n: int = 12) -> tuple[list[tuple[str, float]],
                                                   list[tuple[str, float]]]:
    """From a speedscope file: the functions holding the most samples themselves (self),
    and redbatch's own functions by the samples under them (inclusive); shares of all."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    root = str(OUT.parent.parent)

    def label(i: int) -> str:
        f = frames[i]
        return f"{f['name']} ({Path(f.get('file', '?')).name}:{f.get('line', '?')})"

    for prof in data["profiles"]:
        for sample, weight in zip(prof["samples"], prof["weights"], strict=True):
            if not sample:
                continue
            own[label(sample[-1])] += weight
            ours = {frames[i]["name"] + " (" + Path(frames[i].get("file", "?")).name + ")"
                    for i in sample if frames[i].get("file", "").startswith(root)
                    and "/.venv/" not in frames[i].get("file", "")}
            for name in ours:
                under[name] += weight
    total = sum(own.values()) or 1
    return ([(k, v / total) for k, v in own.most_common(n)],
            [(k, v / total) for k, v in under.most_common(n)])


def measure(args: argparse.Namespace, name: str) -> tuple[dict[str, float], float, str]:
    payloads = payloads_for(args.model)
    with RedisServer() as server:
        worker = start_worker(server.url, name, ["--model", args.model,
                                                 *shlex.split(args.worker_args)],
                              f"cpu_budget-{name}-worker.log")
        try:
            target = RedbatchTarget(server.url, name, payloads)
            closed_loop(server.url, target, args.window, args.warmup_s)
            wproc = psutil.Process(worker.pid)
            procs = {"client": psutil.Process(), "redis-server": server_process(server.port),
                     "worker": wproc,
                     **{f"pool{i}": p for i, p in enumerate(wproc.children(recursive=True))}}
            names = thread_names(worker.pid)
            spy = record(worker.pid, args.seconds, name) if args.record else None
            before, t0 = snapshot(procs, wproc), time.perf_counter()
            run = closed_loop(server.url, target, args.window, args.seconds)
            after, wall = snapshot(procs, wproc), time.perf_counter() - t0
            target.close()
            if spy is not None:
                spy.wait()
        finally:
            worker.stop()
    jobs = len(run.steady) + run.drained
    return budget(before, after, jobs, names), jobs / wall, worker.describe()


def server_process(port: int) -> psutil.Process:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN \
                and conn.pid:
            return psutil.Process(conn.pid)
    raise RuntimeError(f"no process listens on port {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--record", action="store_true", help="py-spy profile of the worker")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    args = parser.parse_args()
    reexec_with_worker_malloc()
    name = model_name_from_spec(args.model)
    parts, rate, described = measure(args, name)
    report(args, name, parts, rate, described)


def report(args: argparse.Namespace, name: str, parts: dict[str, float], rate: float,
           described: str) -> None:
    total = sum(parts.values())
    model_parts = [k for k in parts if k.endswith(MODEL_THREAD) or LANE_THREAD in k]
    model = sum(parts[k] for k in model_parts)
    # The forward passes run on the lanes when there are any, each on its own thread.
    at_once = max(1, sum(LANE_THREAD in k for k in model_parts))
    decode = parts.get("pool processes (decode)", 0.0)
    framework = total - model - decode
    write_csv(f"cpu_budget-{name}.csv", ["part", "cpu_ms_per_job", "share"],
              [[k, fmt(v, 3), fmt(v / total, 3)] for k, v in parts.items()])

    def figure(plt):  # type: ignore[no-untyped-def]
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(parts) + 1.5))
        bars = ax.barh(list(parts), list(parts.values()))
        ax.bar_label(bars, fmt="%.2f")
        ax.invert_yaxis()
        ax.set_xlabel("CPU ms per job (user + system)")
        ax.set_title(f"{args.model}: {rate:.1f} jobs/s, window {args.window}; {described}",
                     fontsize=8)
        ax.grid(axis="x", alpha=0.3)

    plot(f"cpu_budget-{name}.png", figure)
    cores = os.cpu_count() or 1
    print(f"cores={cores} model={args.model} window={args.window} seconds={args.seconds:g} "
          f"worker_args={args.worker_args!r}")
    print(f"worker: {described}")
    print(f"{'part':44s} {'CPU ms/job':>10} {'share':>6}")
    for k, v in parts.items():
        print(f"{k:44s} {v:10.3f} {v / total:6.1%}")
    print(f"{'total':44s} {total:10.3f}")
    print(f"measured {rate:.1f} jobs/s; the cores allow at most {cores * 1000 / total:.1f} "
          f"(all parts in parallel), the model threads alone ({at_once} at once) "
          f"{at_once * 1000 / model if model else float('inf'):.1f}")
    if args.record:
        spy = OUT / f"cpu_budget-{name}.speedscope.json"
        if spy.exists():
            own, under = top_functions(spy)
            print(f"py-spy profile (Python work holding the GIL): {spy}")
            print("  functions with the most samples (self):")
            for fn, share in own:
                print(f"    {share:6.1%}  {fn}")
            print("  redbatch functions by the samples under them (inclusive):")
            for fn, share in under:
                print(f"    {share:6.1%}  {fn}")
    print(machine_load())
    print(f"wrote bench/out/cpu_budget-{name}.csv, bench/out/cpu_budget-{name}.png")
    print(f"RATIO framework CPU (not model threads, not decode) / job CPU = "
          f"{framework:.2f} / {total:.2f} = {framework / total:.2f}")


if __name__ == "__main__":
    main()
