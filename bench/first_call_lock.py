"""What the first-call lock (NOTE [ First calls ] in gpu_worker/device/runner.py) costs a
steady call: the runner's CPU forward pass before and after it, alternated in one process.

    git show 96efac0^:gpu_worker/device/runner.py > /tmp/runner_before.py
    .venv/bin/python bench/first_call_lock.py /tmp/runner_before.py [--rounds 40] [--calls 2000]

A model that returns its input (so the runner's own Python is all there is to time), batch 4,
one lane, torch on one thread; each round times ``--calls`` steady calls of ``_run_now`` on the
old runner and on today's, in turn, with and without bf16 autocast. Prints the median
microseconds per call of each and the difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from redbatch.gpu_worker.device import runner as after_module
from redbatch.gpu_worker.tuning.profile import Variant


class _Identity:
    """A handler around a model that returns its input."""

    input_shape = (3, 4, 4)
    input_dtype = "float32"

    def load(self, device: torch.device) -> Any:
        return lambda x: x

    def postprocess(self, outputs: Any, params: Any) -> list[Any]:
        return list(outputs)


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("runner_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _steady(module: Any, autocast: str | None) -> tuple[Any, Any, torch.Tensor]:
    run = module.ModelRunner(_Identity(), torch.device("cpu"),
                             np.zeros((8, 3, 4, 4), np.float32), 4, Variant(autocast=autocast))
    job, host = module.InFlight([0, 1, 2, 3], [{}] * 4, 4), run._host[0][:4]
    run._run_now(job, host)  # the first call: from here on, steady
    return run, job, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="runner.py from before the lock")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = _load(args.before)
    for autocast in (None, "bfloat16"):
        runs = {"before": _steady(before, autocast), "after": _steady(after_module, autocast)}
        per: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (run, job, host) in runs.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    run._run_now(job, host)
                per[name].append((time.perf_counter() - start) / args.calls * 1e6)
        b, a = statistics.median(per["before"]), statistics.median(per["after"])
        print(f"autocast={autocast or 'none'}: before {b:.2f} us/call, after {a:.2f} us/call "
              f"({a - b:+.2f})")


if __name__ == "__main__":
    main()
