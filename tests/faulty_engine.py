"""``redbatch worker`` with the generation engine's steps made to fail after a few: what a
failed or hung device looks like to the generation worker (tests/test_generation_faults.py).

    python tests/faulty_engine.py raise|hang AFTER <redbatch worker arguments>

``raise``: every step after the first AFTER raises what a lost CUDA device raises;
``hang``: it never returns. Run as a script, in a process of its own, like a worker.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from typing import Any

from redbatch.gpu_worker.device.malloc_tuning import MALLOC_ENV
from redbatch.gpu_worker.generation.engine import Engine

mode, after = sys.argv[1], int(sys.argv[2])
if mode not in ("raise", "hang"):
    raise SystemExit(f"unknown fault {mode!r}: raise or hang")
real_step = Engine.step
steps = [0]


def failing_step(self: Engine) -> Any:
    steps[0] += 1
    if steps[0] > after:
        if mode == "hang":
            threading.Event().wait()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return real_step(self)


Engine.step = failing_step  # type: ignore[method-assign]
os.environ.update(MALLOC_ENV)  # no re-exec: it would start a process without the fault
sys.argv = ["redbatch", "worker", *sys.argv[3:]]
runpy.run_module("redbatch.cli", run_name="__main__", alter_sys=True)
