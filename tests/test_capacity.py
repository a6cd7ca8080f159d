"""The in-flight places: a busy worker reads in groups, an idle one reads what is free
(NOTE [ Reading in groups ] in gpu_worker/batching/capacity.py). Real threads."""

from __future__ import annotations

import threading
import time

from redbatch.gpu_worker.batching.capacity import Capacity


def test_a_busy_worker_waits_for_a_group_of_places_before_reading() -> None:
    capacity = Capacity(16, group=4)
    assert capacity.take_up_to(13, timeout_s=0) == 13  # 13 held: over two groups
    capacity.give_back(1)
    later = threading.Timer(0.05, capacity.give_back, (3,))
    later.start()
    assert capacity.take_up_to(16, timeout_s=1, group_wait_s=30) == 4
    later.join()


def test_the_wait_for_a_group_is_bounded() -> None:
    capacity = Capacity(16, group=4)
    capacity.take_up_to(16, timeout_s=0)
    capacity.give_back(1)
    start = time.monotonic()
    assert capacity.take_up_to(16, timeout_s=1, group_wait_s=0.05) == 1
    assert time.monotonic() - start < 5


def test_a_worker_holding_under_two_groups_reads_what_is_free_at_once() -> None:
    capacity = Capacity(16, group=6)
    assert capacity.take_up_to(11, timeout_s=0) == 11  # 11 held: under two groups of 6
    start = time.monotonic()
    assert capacity.take_up_to(16, timeout_s=1, group_wait_s=30) == 5
    assert time.monotonic() - start < 5
    assert Capacity(4, group=64).group == 2  # at most half the places
