"""redbatch against the serving systems users would pick instead, same model and load, one run.

    .venv/bin/python bench/peers.py [--clients 32] [--steady-s 20] [--open-load 0.8]
                                    [--systems redbatch,celery-solo,celery-prefork,ray,triton]

Systems, each started and stopped here, each serving redbatch's EfficientNet-Lite0 handler
(same Pillow decode and preprocessing, same eager torch forward, same top-5) on the same cores:

* redbatch:        a private redis-server and one ``redbatch worker`` with its defaults
                   (--max-batch-size and --worker-args change them); clients: ``Client.predict``;
* celery-solo:     Celery 5, Redis broker and result backend (a private redis-server), one task
                   per image, JSON with base64 payloads; ``--pool solo``, torch on all cores;
* celery-prefork:  the same with ``--pool prefork --concurrency 2``, one torch thread each;
* ray:             Ray Serve, one replica, ``@serve.batch`` (max batch 16, 5 ms), over HTTP;
* triton:          NVIDIA Triton's dynamic batcher through PyTriton (max batch 16, 5 ms queue
                   delay), clients: pytriton's ModelClient over HTTP.

Load, the same generator for all (bench/peer_systems/load.py): first ``--clients`` closed-loop
clients, each sending a photo from samples/ and waiting for its answer (warm-up, then a steady
phase): capacity and latency at saturation. Then, with every system started afresh, open-loop
Poisson arrivals at ``--open-load`` x the best peer's measured capacity (or ``--rate``), the
same rate for every system: p50/p99 at that load. Latencies are the clients' own clocks.

Every process (servers and clients) runs under the malloc settings the redbatch worker gives
itself (gpu_worker/device/malloc_tuning.py): the script re-executes itself with them and the servers
inherit them, so this compares serving systems, not glibc. A system that cannot be installed
or started is reported as skipped, with the reason; its log is bench/out/peers-<name>.log.

Prints one table and the ratios redbatch / peer last; writes bench/out/peers.csv and
bench/out/peers.png.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer_systems.load import Run, closed_loop, open_loop
from peer_systems.model import VARIANT_ENV
from redbatch.gpu_worker.device import malloc_tuning

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SYSTEMS = ("redbatch", "celery-solo", "celery-prefork", "ray", "triton")
INSTALL_HINT = ("install the peers with: .venv/bin/pip install -e '.[worker,bench]' && "
                ".venv/bin/pip install --no-deps nvidia-pytriton==0.7.0")


@dataclass
class Outcome:
    """One system's results over both passes."""

    key: str
    name: str = ""
    config: str = ""
    closed: Run | None = None
    open: Run | None = None
    skipped: str = ""
    load: list[float] = field(default_factory=list)  # 1-min load average before each phase


def photos() -> list[bytes]:
    return [p.read_bytes() for p in sorted((ROOT / "samples").glob("*.jpg"))]


def factory(key: str, args: argparse.Namespace) -> Callable[[], Any]:
    """A constructor for system ``key``; imports happen when it is called, so a peer that is
    not installed fails there and is skipped."""
    def build() -> Any:
        if key == "redbatch":
            from peer_systems.redbatch_system import RedbatchSystem
            return RedbatchSystem(args.max_batch_size, shlex.split(args.worker_args))
        if key.startswith("celery"):
            from peer_systems.celery_system import CelerySystem
            if key == "celery-solo":
                return CelerySystem("solo", 1, None)
            return CelerySystem("prefork", args.celery_processes, 1)
        if key == "ray":
            from peer_systems.ray_system import RaySystem
            return RaySystem(args.peer_max_batch, args.peer_wait_ms / 1000)
        from peer_systems.triton_system import TritonSystem
        return TritonSystem(args.peer_max_batch, int(args.peer_wait_ms * 1000))
    return build


def run_one(outcome: Outcome, build: Callable[[], Any],
            phase: Callable[[Any, list[bytes]], Run], payloads: list[bytes]) -> Run | None:
    """Start the system, run one phase, stop it; a failure marks the outcome skipped."""
    system = None
    try:
        system = build()
        outcome.name, outcome.config = system.name, system.config
        t0 = time.perf_counter()
        system.start(payloads[0])
        print(f"  {system.name}: up in {time.perf_counter() - t0:.0f}s", flush=True)
        outcome.load.append(os.getloadavg()[0])
        return phase(system, payloads)
    except Exception as e:  # noqa: BLE001 - a peer that fails is reported, never fatal
        outcome.skipped = f"{type(e).__name__}: {e}".replace("\n", " ")[:600]
        if isinstance(e, ImportError):
            outcome.skipped += f" ({INSTALL_HINT})"
        print(f"  {outcome.key}: SKIPPED ({outcome.skipped[:300]})", flush=True)
        if os.environ.get("PEERS_DEBUG"):
            traceback.print_exc()
        return None
    finally:
        if system is not None:
            system.stop()


def closed_phase(args: argparse.Namespace) -> Callable[[Any, list[bytes]], Run]:
    return lambda s, p: closed_loop(s.make_caller, p, args.clients, args.warmup_s, args.steady_s)


def open_phase(args: argparse.Namespace, rate: float) -> Callable[[Any, list[bytes]], Run]:
    return lambda s, p: open_loop(s.make_caller, p, rate, args.warmup_s, args.steady_s,
                                  threads=args.open_threads)


def open_rate(args: argparse.Namespace, outcomes: list[Outcome]) -> float:
    """--rate, else --open-load x the best peer's closed-loop throughput (redbatch's when no
    peer ran)."""
    if args.rate:
        return float(args.rate)
    peers = [o.closed.throughput for o in outcomes if o.closed and o.key != "redbatch"]
    ours = [o.closed.throughput for o in outcomes if o.closed and o.key == "redbatch"]
    base = max(peers) if peers else max(ours, default=0.0)
    return args.open_load * base


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt(x: float, spec: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


def _cells(run: Run | None) -> list[str]:
    if run is None:
        return ["-", "-", "-"]
    return [fmt(run.throughput), fmt(run.pct(50), ".0f"), fmt(run.pct(99), ".0f")]


def _ratios(o: Outcome, ours: Outcome | None) -> list[str]:
    """redbatch / this peer: saturated throughput, saturated p99, p99 under the open load."""
    if ours is None or o.key == "redbatch":
        return ["", "", ""]
    pairs = [(ours.closed, o.closed, "throughput"), (ours.closed, o.closed, "p99"),
             (ours.open, o.open, "p99")]
    return [fmt(ratio(a.throughput, b.throughput) if what == "throughput"
                else ratio(a.pct(99), b.pct(99)), ".2f") if a and b else ""
            for a, b, what in pairs]


def _notes(o: Outcome) -> str:
    notes = [o.config]
    for run in (o.closed, o.open):
        if run and run.errors:
            notes.append(f"{run.mode}: {run.errors} errors, first: {run.first_error}")
        if run and run.unfinished:
            notes.append(f"open: {run.unfinished} unanswered at the end (overloaded)")
    if o.skipped:
        notes.append(f"one pass skipped: {o.skipped[:200]}")
    if o.load:
        notes.append("load avg " + "/".join(f"{x:.1f}" for x in o.load))
    return f"  {o.name or o.key}: " + "; ".join(n for n in notes if n)


def print_table(outcomes: list[Outcome], rate: float) -> None:
    ours = next((o for o in outcomes if o.key == "redbatch"), None)
    head = (f"{'system':16s} {'img/s':>6s} {'p50 ms':>7s} {'p99 ms':>7s} | {'done/s':>6s} "
            f"{'p50 ms':>7s} {'p99 ms':>7s} | {'rb/peer img/s':>13s} {'rb/peer p99':>11s} "
            f"{'rb/peer p99@load':>16s}")
    title = f"open loop, {rate:.1f} req/s" if rate > 0 else "open loop: not run"
    print(f"\n{'':16s} {'closed loop, saturated':^23s} | {title:^23s} |")
    print(head)
    print("-" * len(head))
    for o in outcomes:
        if not (o.closed or o.open):
            print(f"{o.name or o.key:16s} SKIPPED: {o.skipped[:200]}")
            continue
        c, p, r = _cells(o.closed), _cells(o.open), _ratios(o, ours)
        print(f"{o.name or o.key:16s} {c[0]:>6s} {c[1]:>7s} {c[2]:>7s} | {p[0]:>6s} "
              f"{p[1]:>7s} {p[2]:>7s} | {r[0]:>13s} {r[1]:>11s} {r[2]:>16s}")
    print()
    for o in outcomes:
        if o.closed or o.open:
            print(_notes(o))


def out_name(args: argparse.Namespace) -> str:
    """peers, or peers-<variant> when the peers run another variant than eager."""
    return "peers" if args.peer_variant == "eager" else \
        "peers-" + args.peer_variant.replace("+", "-")


def write_csv(outcomes: list[Outcome], name: str) -> None:
    ours = {run.mode: run for o in outcomes if o.key == "redbatch"
            for run in (o.closed, o.open) if run}
    with open(OUT / f"{name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "config", "mode", "clients", "offered_per_s", "requests", "errors",
                    "unfinished", "duration_s", "throughput", "p50_ms", "p95_ms", "p99_ms",
                    "max_ms", "redbatch_over_peer_throughput", "redbatch_over_peer_p99",
                    "skipped"])
        for o in outcomes:
            runs = [r for r in (o.closed, o.open) if r]
            if not runs:
                w.writerow([o.name or o.key, o.config, *[""] * 14, o.skipped])
            for r in runs:
                mine = ours.get(r.mode)
                w.writerow([o.name, o.config, r.mode, r.clients, fmt(r.offered_per_s, ".2f"),
                            len(r.latencies_ms), r.errors, r.unfinished, f"{r.duration_s:g}",
                            fmt(r.throughput, ".2f"), *(fmt(r.pct(q)) for q in (50, 95, 99, 100)),
                            fmt(ratio(mine.throughput, r.throughput), ".3f") if mine else "",
                            fmt(ratio(mine.pct(99), r.pct(99)), ".3f") if mine else "", ""])


def plot(outcomes: list[Outcome], rate: float, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = [o for o in outcomes if o.closed]
    colors = ["tab:red" if o.key == "redbatch" else "tab:gray" for o in done]
    bars = ax1.bar([o.name for o in done],
                   [o.closed.throughput for o in done], color=colors)  # type: ignore[union-attr]
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylabel("images / s")
    ax1.set_title(f"Saturated throughput, {args.clients} closed-loop clients")
    opened = [o for o in outcomes if o.open]
    if not opened:  # --open-load 0: the closed loop alone
        ax2.set_axis_off()
        ax2.text(0.5, 0.5, "no open-loop phase (--open-load 0)", ha="center", va="center")
    x = range(len(opened))
    for shift, q, color in ((-0.2, 50, "tab:blue"), (0.2, 99, "tab:orange")):
        bars = ax2.bar([i + shift for i in x], [o.open.pct(q) for o in opened],  # type: ignore[union-attr]
                       0.4, label=f"p{q}", color=color)
        ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_xticks(list(x), [o.name for o in opened])
    if opened:
        ax2.set_yscale("log")
    ax2.set_ylabel("latency, ms (log)")
    how = "--rate" if args.rate else f"{args.open_load:g} x the best peer's img/s"
    ax2.set_title(f"Latency at {rate:.1f} req/s, open loop ({how})")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"Same model and load, {os.cpu_count()} cores (EfficientNet-Lite0, CPU; "
                 f"peers' forward pass: {args.peer_variant}, redbatch's: its profile's)")
    fig.tight_layout()
    fig.savefig(OUT / f"{out_name(args)}.png", dpi=110)


def print_ratios(outcomes: list[Outcome], rate: float) -> None:
    ours = next((o for o in outcomes if o.key == "redbatch"), None)
    peers = [o for o in outcomes if o.key != "redbatch" and o.closed]
    if ours is None or ours.closed is None or not peers:
        print("RATIO: needs redbatch and at least one peer measured")
        return
    best = max(peers, key=lambda o: o.closed.throughput)  # type: ignore[union-attr]
    for o in peers:
        assert o.closed is not None
        print(f"RATIO redbatch / {o.name:15s} throughput = "
              f"{ratio(ours.closed.throughput, o.closed.throughput):.2f}   p99 saturated = "
              f"{ratio(ours.closed.pct(99), o.closed.pct(99)):.2f}" +
              (f"   p99 at {rate:.1f} req/s = {ratio(ours.open.pct(99), o.open.pct(99)):.2f}"
               if ours.open and o.open else ""))
    assert best.closed is not None
    print(f"RATIO redbatch / best peer ({best.name}) throughput = "
          f"{ratio(ours.closed.throughput, best.closed.throughput):.2f} (target >= 2)")
    if ours.open and best.open:
        print(f"RATIO redbatch / best peer ({best.name}) p99 at {rate:.1f} req/s = "
              f"{ratio(ours.open.pct(99), best.open.pct(99)):.2f} (target <= 0.5)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--open-load", type=float, default=0.8,
                        help="open-loop rate as a fraction of the best peer's capacity; 0: skip")
    parser.add_argument("--rate", type=float, default=None, help="open-loop rate, req/s")
    parser.add_argument("--open-threads", type=int, default=128,
                        help="most requests in flight in the open loop")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="redbatch worker's --max-batch-size (default: the worker's)")
    parser.add_argument("--worker-args", default="", help="extra flags for redbatch worker")
    parser.add_argument("--peer-max-batch", type=int, default=16,
                        help="max batch of Ray Serve and Triton")
    parser.add_argument("--peer-wait-ms", type=float, default=5.0,
                        help="batch wait of Ray Serve, queue delay of Triton")
    parser.add_argument("--celery-processes", type=int, default=2,
                        help="prefork processes of celery-prefork")
    parser.add_argument("--peer-variant", default="eager",
                        help="the peers' model: eager (what a user would wrap), or a redbatch "
                             "variant without compile, e.g. channels_last+bf16, to compare the "
                             "serving alone (writes peers-<variant>.csv/png)")
    args = parser.parse_args()
    args.keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = set(args.keys) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    return args


def main() -> None:
    args = parse_args()
    if malloc_tuning.wanted():  # servers and clients under the worker's malloc settings
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, **malloc_tuning.MALLOC_ENV})
    os.environ[VARIANT_ENV] = args.peer_variant  # inherited by every peer's processes
    payloads = photos()
    outcomes = [Outcome(k) for k in args.keys]
    print(f"cores={os.cpu_count()} clients={args.clients} warm-up {args.warmup_s:g}s steady "
          f"{args.steady_s:g}s peers' model: {args.peer_variant} ({malloc_tuning.describe()})",
          flush=True)
    print("closed loop:", flush=True)
    for o in outcomes:
        o.closed = run_one(o, factory(o.key, args), closed_phase(args), payloads)
    rate = open_rate(args, outcomes)
    if rate > 0:
        print(f"open loop at {rate:.1f} req/s:", flush=True)
        for o in outcomes:
            if o.closed is not None:
                o.open = run_one(o, factory(o.key, args), open_phase(args, rate), payloads)
    OUT.mkdir(parents=True, exist_ok=True)
    print_table(outcomes, rate)
    name = out_name(args)
    write_csv(outcomes, name)
    plot(outcomes, rate, args)
    print(f"wrote bench/out/{name}.csv and bench/out/{name}.png")
    print_ratios(outcomes, rate)


if __name__ == "__main__":
    main()
