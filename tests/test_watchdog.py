"""The device watchdog (gpu_worker/device/watchdog.py): its rule, pure, and its thread on a
fake clock. The whole path, a real worker and `redbatch calibrate` that hang, is in
tests/test_faults.py and tests/test_calibrate.py."""

from __future__ import annotations

import threading

import pytest
from redbatch.gpu_worker.device.watchdog import Watchdog, overdue


def test_the_oldest_watched_call_past_the_bound_is_overdue() -> None:
    watched = {1: ("warm-up at batch 8", 10.0), 2: ("warm-up at batch 1", 4.0)}
    assert overdue(watched, 13.9, 10.0) is None
    assert overdue(watched, 14.0, 10.0) == "warm-up at batch 1"
    assert overdue({}, 1e9, 10.0) is None


def test_a_call_past_its_bound_is_reported_once_and_one_in_time_never() -> None:
    now = [0.0]
    hung: list[tuple[str, float]] = []
    fired = threading.Event()

    def on_hang(stage: str, timeout_s: float) -> None:
        hung.append((stage, timeout_s))
        fired.set()

    with Watchdog(1.0, on_hang, clock=lambda: now[0]) as dog:
        with dog.watch("calibration, eager at batch 1"):
            now[0] = 0.9
        assert not fired.wait(0.3), "returned within its bound"
        with dog.watch("calibration, bf16 at batch 2"):
            now[0] = 2.0
            assert fired.wait(10), "a stuck call is reported"
        with dog.watch("after it fired: the thread is done"):
            now[0] = 100.0
            threading.Event().wait(0.3)
    assert hung == [("calibration, bf16 at batch 2", 1.0)]
    with pytest.raises(ValueError):
        Watchdog(0, on_hang)
