"""How long a worker takes to become ready with a compiled profile: cold, then warm.

    .venv/bin/python bench/startup.py [--profile-dir DIR] [--starts 3] [--photos 120]

Starts `redbatch worker --calibrate load` against a private redis-server ``--starts`` times
in a row, each after the previous stopped, with the calibration profile of DIR (default:
this machine's, REDBATCH_PROFILE_DIR or ~/.cache/redbatch/profiles), and times each from
spawn to ready (its "model ready" line and its place in the consumer group). The first
start after the compiled package was removed (``--cold``, the default) builds it; the
others load it (gpu_worker/device/packaged.py). After each start it scores ``--photos`` sample
photos to show the rate the start leads to. Prints one line per start and the ratio
cold / warm last. Measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from harness import start_worker, workload
from redbatch.cli.redis_server import RedisServer
from redbatch.gpu_worker.tuning.profile import default_profile_dir
from redbatch.producer.client import Client

MODEL = "efficientnet_lite0"


def one_start(profile_dir: Path, photos: list[bytes], i: int) -> tuple[float, float, str]:
    """Seconds to ready, photos/s after it, and how the model was prepared (log line)."""
    env_before = os.environ.get("REDBATCH_PROFILE_DIR")
    os.environ["REDBATCH_PROFILE_DIR"] = str(profile_dir)
    try:
        with RedisServer() as server:
            start = time.perf_counter()
            worker = start_worker(server.url, MODEL, ["--calibrate", "load"],
                                  f"startup-worker-{i}.log")
            ready_s = time.perf_counter() - start
            try:
                with Client(server.url) as client:
                    client.predict(photos[0], timeout_s=300)
                    began = time.perf_counter()
                    client.results(client.submit_many(photos, timeout_s=600), 600)
                    rate = len(photos) / (time.perf_counter() - began)
            finally:
                worker.stop()
    finally:
        if env_before is None:
            os.environ.pop("REDBATCH_PROFILE_DIR", None)
        else:
            os.environ["REDBATCH_PROFILE_DIR"] = env_before
    text = worker.log.read_text(errors="replace")
    how = re.search(r"tuning: (?:built|loaded) compiled package[^\n]*", text) or \
        re.search(r"tuning: from the profile[^\n]*", text)
    return ready_s, rate, how.group(0)[:160] if how else "no profile line"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--photos", type=int, default=120)
    parser.add_argument("--warm", action="store_true",
                        help="keep the compiled packages: every start is warm")
    args = parser.parse_args()
    profile_dir = args.profile_dir or default_profile_dir()
    if not list(profile_dir.glob(f"{MODEL}--*.json")):
        raise SystemExit(f"no {MODEL} profile in {profile_dir}: run `redbatch calibrate` first")
    if not args.warm:
        for package in profile_dir.glob(f"{MODEL}--*.so"):
            package.unlink()
    photos = workload(args.photos)
    ready = []
    for i in range(args.starts):
        ready_s, rate, how = one_start(profile_dir, photos, i)
        ready.append(ready_s)
        print(f"start {i + 1}: ready in {ready_s:5.1f} s, then {rate:6.1f} photos/s; {how}",
              flush=True)
    if len(ready) > 1:
        warm = sorted(ready[1:])[len(ready[1:]) // 2]
        print(f"RATIO first start / later starts (median) = {ready[0]:.1f} / {warm:.1f} s "
              f"= {ready[0] / warm:.1f}  (target: later starts <= 10 s)")


if __name__ == "__main__":
    main()
