"""The preprocessing pool with real processes and real shared memory."""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import SAMPLES, shm_entries
from handlers_for_tests import BULKY, CRASH, SLOW
from redbatch.common.config import LimitSettings, PoolSettings
from redbatch.common.protocol import ErrorCode
from redbatch.handlers import EfficientNetLite0, NullModel
from redbatch.handlers.base import preprocesses_inline
from redbatch.preproc_worker.pool import PreprocPool, _Pace
from redbatch.preproc_worker.shm import SlotAllocator, SlotArray
from redbatch.preproc_worker.worker import PreprocDone, Task, preprocess_group

CAT = (SAMPLES / "cat.jpg").read_bytes()
COFFEE = (SAMPLES / "coffee.jpg").read_bytes()
SPEC = "handlers_for_tests:crashy"
N_SLOTS = 16


class Running:
    def __init__(self, processes: int, crash_retries: int = 1) -> None:
        self.slots = SlotArray.create(N_SLOTS, (3, 224, 224), "float32")
        settings = PoolSettings(processes=processes, crash_retries=crash_retries)
        self.pool = PreprocPool(SPEC, LimitSettings(), settings, self.slots.layout)
        self.messages: queue.Queue[list[PreprocDone]] = queue.Queue()
        self.pump_open = threading.Event()  # cleared: the pump stalls on its next message
        self.pump_open.set()
        self.pump_stalled = threading.Event()
        self.pool.start(on_records=self._on_records)
        self.message_sizes: list[int] = []

    def _on_records(self, records: list[PreprocDone]) -> None:
        if not self.pump_open.is_set():
            self.pump_stalled.set()
        self.pump_open.wait()
        self.messages.put(records)

    def collect(self, n: int, timeout_s: float = 60.0) -> dict[int, PreprocDone]:
        """Wait for n accepted records, reaping dead processes as the worker loop does."""
        done: dict[int, PreprocDone] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < n:
            assert time.monotonic() < deadline, f"only {len(done)} of {n} records"
            for record in self.pool.reap():
                done[record.key] = record
            try:
                records = self.messages.get(timeout=0.1)
            except queue.Empty:
                continue
            self.message_sizes.append(len(records))
            done.update((record.key, record) for record in self.pool.complete(records))
        return done

    def learn_light_tasks(self) -> None:
        """Bad inputs are answered in microseconds: after a few, the pool sizes its chunks
        for light tasks (many to a message) rather than for photos (one or two)."""
        self.pool.submit_many([Task(i, b"not an image", "") for i in range(N_SLOTS)])
        self.collect(N_SLOTS)
        self.message_sizes.clear()

    def close(self) -> None:
        self.pool.close()
        self.slots.close()


def _running(processes: int, crash_retries: int = 1) -> Iterator[Running]:
    before = shm_entries()
    run = Running(processes, crash_retries)
    yield run
    run.close()
    multiprocessing.active_children()  # forget processes that were reaped
    gc.collect()  # queue semaphores are unlinked when collected, as at process exit
    assert shm_entries() <= before, "shared memory or semaphores left behind"


@pytest.fixture
def running() -> Iterator[Running]:
    yield from _running(processes=2)


@pytest.fixture
def one_process() -> Iterator[Running]:
    yield from _running(processes=1)


@pytest.fixture
def one_process_no_retry() -> Iterator[Running]:
    yield from _running(processes=1, crash_retries=0)


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


def test_light_tasks_cross_in_chunks_and_come_back_in_order(one_process: Running) -> None:
    run = one_process
    run.learn_light_tasks()
    tasks = [Task(i, CAT if i in (3, 9) else b"not an image", "") for i in range(12)]
    keys = run.pool.submit_many(tasks)
    done = run.collect(len(tasks))
    assert list(done) == keys and len(set(keys)) == len(keys)
    assert max(run.message_sizes) > 1, "records came back one message each"
    for key, task in zip(keys, tasks, strict=True):
        assert done[key].slot == task.slot
        assert done[key].error_code is (None if task.payload is CAT else ErrorCode.BAD_IMAGE)
    expected = np.empty((3, 224, 224), np.float32)
    EfficientNetLite0(LimitSettings()).preprocess(CAT, "", {}, expected)
    np.testing.assert_array_equal(run.slots.array[9], expected)


def test_a_crash_mid_chunk_charges_only_the_task_in_hand(one_process_no_retry: Running) -> None:
    # One chunk: photos, the poison, photos, and no retry: whatever the dead process held
    # and was charged with is given up at once, so only the poison may be.
    run = one_process_no_retry
    run.learn_light_tasks()
    tasks = [Task(i, CRASH if i == 4 else CAT, "") for i in range(9)]
    keys = run.pool.submit_many(tasks)
    done = run.collect(len(tasks))
    assert run.pool.restarts == 1
    assert done[keys[4]].error_code is ErrorCode.PREPROCESS_CRASHED
    assert all(done[k].error_code is None for k in keys[:4] + keys[5:])
    assert all(done[k].attempt == 1 for k in keys[5:]), "they were in the dead one's chunk"


def test_a_process_killed_mid_write_takes_only_its_own_pipe_down(running: Running) -> None:
    # The pump stalls on a first record, so a 1 MB record fills its process's pipe and the
    # process blocks mid-message. It is killed there: the torn message must cost only that
    # process's pipe, and the other process and the replacement must go on answering
    # (through one shared queue, the dead writer's lock wedged the whole pool).
    running.pump_open.clear()
    first = running.pool.submit(0, b"not an image", "", {})
    assert running.pump_stalled.wait(timeout=30)
    bulky = running.pool.submit(1, BULKY, "", {})
    child = _holding(running.pool, bulky)
    time.sleep(0.3)  # long past the refusal: the process is in its send
    os.kill(child, signal.SIGKILL)
    good = [running.pool.submit(i, CAT, "", {}) for i in range(2, 6)]
    running.pump_open.set()
    done = running.collect(6)
    assert running.pool.restarts == 1
    assert done[first].error_code is ErrorCode.BAD_IMAGE
    assert done[bulky].error_code is ErrorCode.BAD_INPUT and done[bulky].attempt == 1
    assert len(done[bulky].message) == 1_000_000
    assert all(done[k].error_code is None for k in good)


def _holding(pool: PreprocPool, key: int, timeout_s: float = 30.0) -> int:
    """The pid of the process working on task ``key`` (white box: its shared ``current``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in pool._children:
            if child.current.value == key:
                return int(child.process.pid)
        time.sleep(0.01)
    raise AssertionError(f"no process took task {key}")


def test_urgent_tasks_lead_their_chunk(one_process: Running) -> None:
    run = one_process
    run.learn_light_tasks()
    keys = run.pool.submit_many([Task(i, CAT, "", urgent=i >= 3) for i in range(7)])
    assert list(run.collect(7)) == keys[3:] + keys[:3]


def test_waiting_tasks_are_shared_among_processes(running: Running) -> None:
    # Four one-second tasks on two processes: two each take two seconds, all on one four.
    running.learn_light_tasks()
    start = time.monotonic()
    running.pool.submit_many([Task(i, SLOW + b"x", "") for i in range(4)])
    running.collect(4)
    assert time.monotonic() - start < 3.5


class _InlineNull(NullModel):
    inline_preprocess = True


def test_an_inline_group_writes_the_pools_pixels_and_error_records() -> None:
    handler = EfficientNetLite0(LimitSettings())
    assert not preprocesses_inline(handler) and preprocesses_inline(_InlineNull(LimitSettings()))
    slots = SlotArray.create(4, (3, 224, 224), "float32")
    try:
        inputs: list[tuple[int, bytes, str, dict[str, object]]] = [
            (2, CAT, "", {}), (0, b"not an image", "", {}), (3, COFFEE, "", {})]
        outcomes = preprocess_group(handler, slots, inputs)
        assert len(outcomes) == 3
        expected = np.empty((3, 224, 224), np.float32)
        for (slot, payload, _, _), outcome in zip(inputs, outcomes, strict=True):
            code, message, ms, cost, rows = outcome
            if payload.startswith(b"not"):
                assert code is ErrorCode.BAD_IMAGE and message
                continue
            assert code is None and ms > 0 and (cost, rows) == (0, 1)  # an image: no cost
            handler.preprocess(payload, "", {}, expected)
            np.testing.assert_array_equal(slots.array[slot], expected)
    finally:
        slots.close()


@pytest.mark.parametrize(("prefetch_ms", "bound"), [(5.0, 2), (20.0, 9), (1000.0, 64)])
def test_a_process_holds_the_prefetch_in_ms_of_recent_work(prefetch_ms: float,
                                                           bound: int) -> None:
    """At 2.2 ms a photo (the first H200 run's pool), 5 ms holds 2 tasks, sent one a
    message; 20 ms holds 9, sent 4 a message; never more than MAX_PREFETCH."""
    pace = _Pace(prefetch_ms)
    pace.observe([PreprocDone(i, i, preprocess_ms=2.2) for i in range(8)])
    assert (pace.bound, pace.chunk) == (bound, bound // 2)
    with pytest.raises(ValueError, match="prefetch"):
        PoolSettings(prefetch_ms=0)


def test_a_process_holds_enough_to_outlast_the_refill() -> None:
    """At 2.2 ms a photo and 5 ms of prefetch, a process holds 2 tasks; when records take
    3 ms (90th percentile) to come back and be refilled, one held task would run out first:
    it holds 2 x REFILL_MARGIN x 3 ms of work instead, and goes back once trips are short."""
    from redbatch.preproc_worker.pool import REFILL_MARGIN
    pace = _Pace(5.0)
    now = 1000.0
    slow = [PreprocDone(i, i, preprocess_ms=2.2, finished_s=now - 0.003) for i in range(32)]
    pace.observe(slow, now_s=now)
    assert pace.bound == math.ceil(2 * REFILL_MARGIN * 3.0 / 2.2) == 6 and pace.chunk == 3
    quick = [PreprocDone(i, i, preprocess_ms=2.2, finished_s=now - 0.0002) for i in range(32)]
    pace.observe(quick, now_s=now)
    assert pace.bound == 2
