"""Fixtures: a real redis-server per session, a flushed client per test, real worker processes."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import psutil
import pytest
import redis
import redis.cluster
from cluster import LocalCluster
from redbatch.cli.local_stack import (
    count_consumers,
    spawn_worker,
    stop_worker,
    wait_worker_ready,
)
from redbatch.cli.redis_server import RedisServer, RedisServerError, find_redis_server
from redbatch.common.config import Settings, model_name_from_spec
from redbatch.common.protocol import Keys
from redbatch.common.redis_io import connect
from redbatch.producer.client import Client

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
#: What EfficientNet-Lite0 may call samples/cat.jpg (and crops of it).
CAT_LABELS = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat", "lynx"}
TEST_MODEL = "efficientnet_lite0"
#: The profile directory's variable, kept when a test's environment drops the other
#: REDBATCH_* settings: the session points it at an empty folder (no_calibration_by_default).
PROFILE_DIR_ENV = "REDBATCH_PROFILE_DIR"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=None,
                     help="use this Redis (it will be FLUSHALLed) instead of starting one")


@pytest.fixture(scope="session", autouse=True)
def no_calibration_by_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Workers the tests start by hand neither calibrate nor load a profile (a profile in
    this machine's cache would change their batch sizes); tests that want one pass
    --calibrate, which wins over the variable. The profile directory is an empty one of
    the session's, so private stacks (which load a profile) find none of this machine's
    either; tests that want profiles name their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDBATCH_CALIBRATE", "off")
        mp.setenv(PROFILE_DIR_ENV, str(tmp_path_factory.mktemp("no-profiles")))
        yield


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    url = request.config.getoption("--redis-url")
    if url:
        if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
            # Each process would FLUSHALL the other's keys from under it.
            pytest.fail("--redis-url serves one pytest process: run with -n 0",
                        pytrace=False)
        yield url
        return
    try:
        find_redis_server()
    except RedisServerError as e:
        # A skipped Redis test hides regressions; fail loudly instead.
        pytest.fail(str(e), pytrace=False)
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.flushall()
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(TEST_MODEL)


@pytest.fixture
def client(redis_url: str, r: redis.Redis) -> Iterator[Client]:
    """A client of the test model on the session's Redis, flushed for this test (``r``)."""
    with Client(redis_url, model=TEST_MODEL) as c:
        yield c


@pytest.fixture(scope="session")
def session_cluster() -> Iterator[LocalCluster]:
    """One local Redis Cluster (tests/cluster.py) for every test of the session that uses
    ``cluster``: started once, stopped at the end."""
    with LocalCluster() as c:
        yield c


@pytest.fixture
def cluster(session_cluster: LocalCluster) -> LocalCluster:
    """The session's cluster, whole: a node an earlier test killed (a failover, the cluster
    taken away) is started again and every node is ready, whatever that test left."""
    session_cluster.restore()
    return session_cluster


@pytest.fixture
def rc(cluster: LocalCluster) -> Iterator[redis.Redis]:
    """A cluster client; every master flushed before and after the test."""
    client = connect(cluster.url)
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    yield client
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    client.close()


WorkerFactory = Callable[..., subprocess.Popen[bytes]]


class GoldenVectors:
    """The text model's reference vectors, read from tests/data/minilm_golden.json (written
    once by tests/make_minilm_golden.py with sentence-transformers, the reference
    implementation, reading the same files from the model's wheel). ``encode`` answers as
    sentence-transformers' own does with ``normalize_embeddings=True``, for the texts the
    file holds; another text is a KeyError that says how to add it."""

    def __init__(self, path: Path) -> None:
        golden = json.loads(path.read_text(encoding="utf-8"))
        self._vectors = {text: np.frombuffer(base64.b64decode(b64), dtype="<f4")
                         for text, b64 in golden["vectors"].items()}

    def encode(self, texts: list[str], normalize_embeddings: bool = False) -> np.ndarray:
        assert normalize_embeddings, "the file holds normalised vectors"
        missing = [t[:60] for t in texts if t not in self._vectors]
        if missing:
            raise KeyError(f"no reference vector for {missing}: add the texts to "
                           "tests/make_minilm_golden.py's TEXTS and run it")
        return np.stack([self._vectors[t] for t in texts])


@pytest.fixture(scope="session")
def reference() -> GoldenVectors:
    """The text model's reference answers (GoldenVectors: the reference implementation's
    vectors, computed once; workers and tests never import sentence-transformers)."""
    return GoldenVectors(Path(__file__).parent / "data" / "minilm_golden.json")


@pytest.fixture
def start_worker(redis_url: str, r: redis.Redis,
                 tmp_path: Path) -> Iterator[WorkerFactory]:
    """Start real worker processes; each is stopped (SIGTERM, then SIGKILL) after the test.

    Logs go to tmp_path/worker-N.log and are printed when a test fails.
    """
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(*args: str, wait: bool = True, model: str = TEST_MODEL,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = tmp_path / f"worker-{len(procs)}.log"
        # Several workers run at once: none takes the default metrics port unless asked to.
        metrics = [] if "--metrics-port" in args else ["--metrics-port", "0"]
        # No calibration profile (none measured, none loaded) unless the test asks for one:
        # fast starts, and the defaults every other test expects.
        calibrate = [] if "--calibrate" in args else ["--calibrate", "off"]
        name = (args[args.index("--model-name") + 1] if "--model-name" in args
                else model_name_from_spec(model)) if wait else ""
        # Another worker of the model may have joined the group already: wait for this one.
        before = count_consumers(r, Keys(name)) if wait else 0
        with open(log, "wb") as out:
            proc = spawn_worker(redis_url, ["--model", model, "--max-wait-ms", "5", *metrics,
                                            *calibrate, *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append((proc, log))
        if wait:
            wait_worker_ready(redis_url, Keys(name), proc, consumers_before=before)
        return proc

    yield start
    for proc, log in procs:
        stop_worker(proc, timeout_s=20)
        if os.environ.get("REDBATCH_TEST_SHOW_LOGS"):
            print(log.read_text(errors="replace"))


#: Start of the /dev/shm names of every worker the tests start (REDBATCH_SHM_PREFIX, which
#: marked_env keeps): the leak checks count only this run's entries, whatever runs beside it.
SHM_PREFIX = f"rbt{secrets.token_hex(3)}"


def shm_entries() -> set[str]:
    """This run's names in /dev/shm: the segments and semaphores of the workers it starts
    (SHM_PREFIX, or a prefix a test made from it) and of the pools made in this process
    (this pid, whatever the prefix)."""
    own = re.compile(rf"(sem\.)?({SHM_PREFIX}[A-Za-z0-9_]*-[0-9]+|[A-Za-z0-9_]+-{os.getpid()})"
                     r"-[0-9a-f]{6}(-[A-Za-z0-9_]+)?")
    return {name for name in os.listdir("/dev/shm") if own.fullmatch(name)}


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    """Every worker, pool and stack the tests start must release its /dev/shm entries."""
    import gc
    import time

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDBATCH_SHM_PREFIX", SHM_PREFIX)
        before = shm_entries()
        yield
    gc.collect()
    deadline = time.monotonic() + 20  # a SIGKILLed worker's tracker needs a moment
    while not shm_entries() <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = shm_entries() - before
    assert not left, f"left in /dev/shm by the tests: {sorted(left)}"


def worker_settings(env: Mapping[str, str], *args: str) -> Settings:
    """The Settings ``redbatch worker ARGS`` builds where its only REDBATCH_* variables are
    ``env``'s: parsed, and explicit settings told apart, as the command does; not run."""
    from click.testing import CliRunner
    from redbatch.cli.worker import _explicit, build_settings, worker

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("REDBATCH_")}
    with CliRunner().isolation(env={**unset, **env}):
        ctx = worker.make_context("worker", list(args))
        return build_settings({**ctx.params, "explicit": _explicit(ctx)})


def settings_free_env() -> dict[str, str]:
    """The test's environment without REDBATCH_* settings, but the session's empty profile
    directory (no_calibration_by_default): what a command run by a test starts from."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("REDBATCH_") or k == PROFILE_DIR_ENV}


def marked_env(mark: str) -> dict[str, str]:
    """The test's environment without REDBATCH_* settings (but the run's shm prefix, for
    the leak check), plus a mark that every process started from it inherits, so
    leftovers can be found even among other runs' processes."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("REDBATCH_") or k in ("REDBATCH_SHM_PREFIX", PROFILE_DIR_ENV)}
    env["REDBATCH_TEST_MARK"] = mark
    return env


def processes_with_mark(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("REDBATCH_TEST_MARK") == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
