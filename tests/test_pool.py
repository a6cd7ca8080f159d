"""The preprocessing pool with real processes and real shared memory."""

from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import SAMPLES, shm_entries
from handlers_for_tests import CRASH, SLOW
from redbatch.common.config import LimitSettings, PoolSettings
from redbatch.common.protocol import ErrorCode
from redbatch.handlers import EfficientNetLite0
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotAllocator, SlotArray
from redbatch.preproc_worker.worker import PreprocDone

CAT = (SAMPLES / "cat.jpg").read_bytes()
COFFEE = (SAMPLES / "coffee.jpg").read_bytes()
SPEC = "handlers_for_tests:crashy"
N_SLOTS = 16


class Running:
    def __init__(self, processes: int) -> None:
        self.slots = SlotArray.create(N_SLOTS, (3, 224, 224), "float32")
        self.pool = PreprocPool(SPEC, LimitSettings(), PoolSettings(processes=processes),
                                self.slots.layout)
        self.records: queue.Queue[PreprocDone] = queue.Queue()
        self.pool.start(on_done=self.records.put)

    def collect(self, n: int, timeout_s: float = 60.0) -> dict[int, PreprocDone]:
        """Wait for n accepted records, reaping dead processes as the worker loop does."""
        done: dict[int, PreprocDone] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < n:
            assert time.monotonic() < deadline, f"only {len(done)} of {n} records"
            for record in self.pool.reap():
                done[record.key] = record
            try:
                record = self.records.get(timeout=0.1)
            except queue.Empty:
                continue
            if self.pool.complete(record):
                done[record.key] = record
        return done

    def close(self) -> None:
        self.pool.close()
        self.slots.close()


@pytest.fixture
def running() -> Iterator[Running]:
    before = shm_entries()
    run = Running(processes=2)
    yield run
    run.close()
    multiprocessing.active_children()  # forget processes that were reaped
    gc.collect()  # queue semaphores are unlinked when collected, as at process exit
    assert shm_entries() <= before, "shared memory or semaphores left behind"


def test_pool_writes_the_same_pixels_as_in_process_preprocessing(running: Running) -> None:
    keys = {running.pool.submit(slot, data, "image/jpeg", {}): (slot, data)
            for slot, data in [(3, CAT), (7, COFFEE)]}
    done = running.collect(2)
    expected = np.empty((3, 224, 224), np.float32)
    for key, (slot, data) in keys.items():
        assert done[key].error_code is None and done[key].slot == slot
        EfficientNetLite0(LimitSettings()).preprocess(data, "", {}, expected)
        np.testing.assert_array_equal(running.slots.array[slot], expected)


def test_bad_input_is_a_record_not_a_dead_process(running: Running) -> None:
    pids = running.pool.pids()
    key = running.pool.submit(0, b"not an image", "", {})
    assert running.collect(1)[key].error_code is ErrorCode.BAD_IMAGE
    assert running.pool.pids() == pids and running.pool.restarts == 0


def test_killed_process_is_replaced_and_its_tasks_finish(running: Running) -> None:
    # Slow tasks keep both processes busy, then one of them is SIGKILLed mid-task.
    slow = [running.pool.submit(i, SLOW + b"x", "", {}) for i in range(4)]
    good = [running.pool.submit(i, CAT, "", {}) for i in range(4, 8)]
    time.sleep(0.5)
    os.kill(running.pool.pids()[0], signal.SIGKILL)
    done = running.collect(8)
    assert running.pool.restarts == 1
    assert all(done[k].error_code is ErrorCode.BAD_IMAGE for k in slow)
    assert all(done[k].error_code is None for k in good)
    assert len(set(running.pool.pids())) == 2


def test_poison_input_is_answered_after_its_retries(running: Running) -> None:
    poison = running.pool.submit(0, CRASH, "", {})
    good = [running.pool.submit(i, CAT, "", {}) for i in range(1, 6)]
    done = running.collect(6)
    assert done[poison].error_code is ErrorCode.PREPROCESS_CRASHED
    assert all(done[k].error_code is None for k in good)
    assert running.pool.restarts == 2  # first try and one retry (crash_retries=1)


def test_slot_allocator_recycles_and_refuses_double_release() -> None:
    alloc = SlotAllocator(2)
    a, b = alloc.acquire(), alloc.acquire()
    assert {a, b} == {0, 1} and alloc.acquire() is None and alloc.in_use == 2
    assert a is not None
    alloc.release(a)
    with pytest.raises(ValueError):
        alloc.release(a)
    assert alloc.acquire() == a


def test_urgent_tasks_go_first_and_in_arrival_order() -> None:
    # One process with its two prefetched places taken by slow tasks: the rest wait, and
    # must come out interactive first, oldest first (newest-first starved the oldest).
    run = Running(processes=1)
    try:
        busy = [run.pool.submit(i, SLOW + b"x", "", {}) for i in range(2)]
        bulk = [run.pool.submit(i, CAT, "", {}) for i in range(2, 5)]
        urgent = [run.pool.submit(i, CAT, "", {}, urgent=True) for i in range(5, 9)]
        order = list(run.collect(9))
    finally:
        run.close()
    assert order == busy + urgent + bulk
