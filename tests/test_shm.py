"""Shared-memory names that say whose they are, and the sweep of a dead worker's leftovers,
with real processes, real segments and semaphores in /dev/shm, and real workers."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import SAMPLES, SHM_PREFIX, WorkerFactory
from redbatch.cli.local_stack import stop_worker
from redbatch.common.protocol import GROUP, Keys, Lane
from redbatch.preproc_worker.shm import SHM_DIR, SlotArray, segment_name, sweep_orphans
from redbatch.producer.client import Client

NULL = Keys("null")

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="Linux keeps shm in /dev/shm")

# A process that makes a segment and a queue (three semaphores named after the segment), as
# a worker does, prints the segment's name, and closes both when a line arrives on stdin.
HOLDER = """
import multiprocessing as mp, sys
from redbatch.preproc_worker.shm import SlotArray, name_semaphores_after
slots = SlotArray.create(2, (4,), "float32", prefix=sys.argv[1])
name_semaphores_after(slots.layout.name)
queue = mp.get_context("spawn").Queue()
print(slots.layout.name, flush=True)
sys.stdin.readline()
queue.close()
slots.close()
"""


# A process that makes a segment and starts a pool of one process on it, prints the
# segment's name and what /dev/shm holds of it (the pool's queue semaphores), and closes.
POOL_HOLDER = """
import os, sys
from redbatch.common.config import LimitSettings, PoolSettings
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotArray
slots = SlotArray.create(4, (3, 8, 8), "float32", prefix=sys.argv[1])
pool = PreprocPool("null", LimitSettings(), PoolSettings(processes=1), slots.layout)
try:
    pool.start(on_records=lambda records: None)
    name = slots.layout.name
    print(name, *[n for n in os.listdir("/dev/shm") if name in n and n != name])
finally:
    pool.close()
    slots.close()
"""


def entries(prefix: str, pid: int | None = None) -> set[str]:
    """Names in /dev/shm of ``prefix`` (segments and their semaphores), of one pid if given."""
    pid_part = "[0-9]+" if pid is None else str(pid)
    pattern = re.compile(rf"(sem\.)?{prefix}-{pid_part}-[0-9a-f]{{6}}(-.+)?")
    return {name for name in os.listdir(SHM_DIR) if pattern.fullmatch(name)}


class Holder:
    """A HOLDER process in a session (process group) of its own, like a worker."""

    def __init__(self, prefix: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, prefix], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        self.segment = self.proc.stdout.readline().strip()
        assert self.segment, "the holder made no segment"

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=30)

    def kill_group(self) -> None:
        """SIGKILL the holder and its resource tracker at once, as the OOM killer or a
        supervisor killing the process group would."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix of this test's own (still counted by the session's leak check)."""
    own = f"{SHM_PREFIX}t"
    yield own
    for name in entries(own):  # a failed test's leftovers, so the session check stays useful
        (SHM_DIR / name).unlink(missing_ok=True)


def plant(name: str, age_s: float = 0.0) -> str:
    """An unlocked /dev/shm entry (on Linux a POSIX shm object is a file there), aged."""
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return name


def test_names_carry_prefix_and_pid_and_the_pool_semaphores_follow(prefix: str) -> None:
    # In a fresh interpreter, as a worker is: a library imported by another test (such as
    # sentence-transformers, which brings ``multiprocess``) changes how this process's
    # semaphores are made.
    out = subprocess.run([sys.executable, "-c", POOL_HOLDER, prefix], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, *seen = out.stdout.split()
    assert re.fullmatch(rf"{prefix}-[0-9]+-[0-9a-f]{{6}}", name)
    sems = set(seen) - {name}
    assert sems and all(s.startswith(f"sem.{name}-") for s in sems), sems
    # The longest prefix and pid (2**22) still fit the 31 characters some systems allow.
    assert len("/" + segment_name("p" * 12).replace(f"-{os.getpid()}-", "-4194304-")) == 28
    for bad in ("", "a-b", "p" * 13, "../x", "sem.x"):
        with pytest.raises(ValueError, match="shared-memory prefix"):
            SlotArray.create(1, (1,), "float32", prefix=bad)


def test_sweep_takes_what_dead_creators_left_and_nothing_alive(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    dead, live = Holder(prefix), Holder(prefix)
    try:
        dead.kill_group()
        left = entries(prefix, dead.proc.pid)
        assert dead.segment in left and len(left) == 4, "segment and 3 semaphores stay"
        os.utime(SHM_DIR / live.segment, (0, 0))  # locked: alive, however old
        live_before = entries(prefix, live.proc.pid)
        # Unlocked segments named with a live pid: one just made (its creator may be about
        # to lock it) stays; an old one is an orphan whose pid was reused.
        young = plant(f"{prefix}-{live.proc.pid}-00000a")
        reused = plant(f"{prefix}-{live.proc.pid}-00000b", age_s=3600)
        mine = plant(f"{prefix}-{os.getpid()}-00000c")  # our pid: a previous life of ours
        sem_only = plant(f"sem.{prefix}-{dead.proc.pid}-00000d-abc123")
        other = plant(f"{prefix}x-{dead.proc.pid}-00000e")  # another prefix
        with caplog.at_level(logging.WARNING, logger="redbatch.preproc_worker.shm"):
            reclaimed = sweep_orphans(prefix)
        assert sorted(reclaimed) == sorted([dead.segment, reused, mine,
                                            f"{prefix}-{dead.proc.pid}-00000d"])
        assert entries(prefix, dead.proc.pid) == set()
        assert entries(prefix, live.proc.pid) == live_before | {young}
        assert (SHM_DIR / other).exists()
        lines = [r.getMessage() for r in caplog.records if "reclaimed" in r.getMessage()]
        assert len(lines) == 4
        assert any(f"(pid {dead.proc.pid}): {dead.segment}" in line
                   and "3 semaphores" in line for line in lines), lines
        assert sem_only not in os.listdir(SHM_DIR)
    finally:
        live.close()
        (SHM_DIR / f"{prefix}x-{dead.proc.pid}-00000e").unlink(missing_ok=True)
    assert entries(prefix) == {young}
    (SHM_DIR / young).unlink()


def joined(r: redis.Redis, consumer: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait until the null model's group has ``consumer`` (start_worker only waits for any
    consumer, and the first worker is one)."""
    deadline = time.monotonic() + 120
    while consumer.encode() not in {c["name"] for c in r.xinfo_consumers(NULL.stream(
            Lane.INTERACTIVE), GROUP)}:
        assert proc.poll() is None and time.monotonic() < deadline, f"{consumer} never joined"
        time.sleep(0.1)


def test_a_worker_group_killed_leaves_shm_that_the_next_worker_reclaims_at_start(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, prefix: str,
        tmp_path: Path) -> None:
    def start(name: str) -> subprocess.Popen[bytes]:
        proc = start_worker("--pool-processes", "1", "--shm-prefix", prefix,
                            "--consumer", name, model="null")
        joined(r, name, proc)
        return proc

    live = start("live")
    victim = start("victim")
    live_entries, left = entries(prefix, live.pid), entries(prefix, victim.pid)
    assert len(live_entries) > 1 and len(left) > 1, "each has a segment and semaphores"
    os.killpg(victim.pid, signal.SIGKILL)  # worker, pool and resource tracker at once
    victim.wait()
    time.sleep(1.0)  # were anyone left to clean up, it would have started
    assert entries(prefix, victim.pid) == left, "nobody reclaimed them"
    sweeper = start("sweeper")
    assert entries(prefix, victim.pid) == set()
    assert entries(prefix, live.pid) == live_entries, "a live worker's entries untouched"
    log = (tmp_path / "worker-2.log").read_text()
    lines = [line for line in log.splitlines() if "reclaimed shared memory" in line]
    assert len(lines) == 1 and f"(pid {victim.pid}): " in lines[0], lines
    stop_worker(sweeper)
    with Client(redis_url, model="null") as client:  # the live worker alone serves it
        assert client.predict((SAMPLES / "cat.jpg").read_bytes(), timeout_s=60).ok
    assert stop_worker(live) == 0
    deadline = time.monotonic() + 20  # the tracker unlinks a stopped worker's semaphores
    while entries(prefix) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert entries(prefix) == set()


def test_a_bad_prefix_is_one_line_not_a_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "worker", "--redis",
                           "redis://127.0.0.1:1/0", "--model", "null", "--metrics-port", "0",
                           "--calibrate", "off", "--shm-prefix", "../x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[-1] == ("Error: invalid shared-memory prefix '../x': "
                                            "use 1-12 of [A-Za-z0-9_]")
    assert "Traceback" not in proc.stderr
