"""The worker's malloc settings keep a forward pass in the model thread free of page faults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from redbatch.common import malloc_tuning

# Batch 16 of the default model in a thread that is not the main one, as the worker's model
# thread runs it; prints the fewest page faults of three passes after a first one (the
# fewest: the kernel may reclaim idle pages now and then, which faults whatever malloc does).
FORWARD_IN_A_THREAD = """
import resource, threading, torch
from redbatch.gpu_worker.efficientnet_lite import load_efficientnet_lite0
torch.set_num_threads(1)
model, x, faults = load_efficientnet_lite0(), torch.zeros(16, 3, 224, 224), []
def forward():
    with torch.inference_mode():
        model(x)
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            model(x)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=forward)
thread.start()
thread.join()
print(min(faults))
"""


def faults_per_forward(env: dict[str, str]) -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", FORWARD_IN_A_THREAD], env={**base, **env},
                          capture_output=True, text=True, timeout=300, check=True)
    return int(proc.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_one_arena_is_what_removes_the_faults_in_the_model_thread() -> None:
    # A 77 MB activation does not fit a thread arena's 64 MiB heap: without one arena it
    # is mapped and unmapped on every pass, whatever the thresholds.
    thresholds_only = {k: v for k, v in malloc_tuning.MALLOC_ENV.items()
                       if k != "MALLOC_ARENA_MAX"}
    assert faults_per_forward(thresholds_only) > 50_000
    assert faults_per_forward(malloc_tuning.MALLOC_ENV) < 5_000
