"""The command line: help, settings from flags and REDBATCH_* variables, submit, private stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from conftest import (
    CAT_LABELS,
    SAMPLES,
    WorkerFactory,
    marked_env,
    processes_with_mark,
    shm_entries,
    worker_settings,
)
from redbatch.cli import main
from redbatch.cli.worker import build_settings, worker
from redbatch.common.config import Settings


def _worker_options(args: list[str], env: dict[str, str] | None = None) -> dict[str, object]:
    """Parse worker options exactly as the command does, without running it."""
    ctx = worker.make_context("worker", args)
    return dict(ctx.params)


def test_help_names_commands_and_variables() -> None:
    out = CliRunner().invoke(main, ["--help"]).output
    assert "worker" in out and "submit" in out and "REDBATCH_REDIS_URL" in out
    out = CliRunner().invoke(main, ["worker", "--help"]).output
    for var in ("REDBATCH_MAX_BATCH_SIZE", "REDBATCH_MAX_WAIT_MS", "REDBATCH_DEVICE",
                "REDBATCH_POOL_PROCESSES", "REDBATCH_MODEL"):
        assert var in out
    # What the calibration profile decides shows no fixed default.
    flat = " ".join(out.split())
    assert "default: no-channels-last" not in flat and "default: no-compile" not in flat
    assert flat.count("the calibration profile's; without one, off") == 3


def test_flags_build_one_settings_object() -> None:
    s = build_settings(_worker_options(["--redis", "redis://h:1/2", "--max-batch-size", "32",
                                        "--max-wait-ms", "7.5", "--pool-processes", "3",
                                        "--model", "/models/resnet50.pt", "--device", "cpu"]))
    assert s.redis.url == "redis://h:1/2"
    assert (s.batch.max_batch_size, s.batch.max_wait_ms) == (32, 7.5)
    assert s.batch.max_inflight >= 32, "in-flight room always fits a full batch"
    assert s.pool.processes == 3 and s.model.device == "cpu"
    assert s.model.served_name == "resnet50"


def test_environment_variables_set_the_same_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDBATCH_REDIS_URL", "redis://env:6379/0")
    monkeypatch.setenv("REDBATCH_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("REDBATCH_MODEL_NAME", "catdog")
    monkeypatch.setenv("REDBATCH_PREFIX", "staging")
    s = build_settings(_worker_options([]))
    assert s.redis.url == "redis://env:6379/0" and s.redis.prefix == "staging"
    assert s.batch.max_batch_size == 4 and s.model.served_name == "catdog"


def test_result_replicas_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    s = build_settings(_worker_options([]))
    assert (s.result_replicas, s.result_wait_ms) == (0, 100), "off by default"
    s = build_settings(_worker_options(["--result-replicas", "2", "--result-wait-ms", "250"]))
    assert (s.result_replicas, s.result_wait_ms) == (2, 250)
    monkeypatch.setenv("REDBATCH_RESULT_REPLICAS", "1")
    monkeypatch.setenv("REDBATCH_RESULT_WAIT_MS", "40")
    s = build_settings(_worker_options([]))
    assert (s.result_replicas, s.result_wait_ms) == (1, 40)
    # WAIT 0 blocks for ever; a wait past the socket timeout would cut the connection.
    result = CliRunner().invoke(main, ["worker", "--result-wait-ms", "0"])
    assert result.exit_code == 2 and "result-wait-ms" in result.output
    with pytest.raises(ValueError, match="socket timeout"):
        Settings(result_wait_ms=10_000)


def test_settings_repr_hides_the_redis_password() -> None:
    s = build_settings(_worker_options(["--redis", "redis://user:secret@h:6379/0"]))
    assert "secret" not in repr(s) and "user:***@h" in repr(s)


def test_invalid_values_are_refused_with_a_message() -> None:
    result = CliRunner().invoke(main, ["worker", "--max-batch-size", "0"])
    assert result.exit_code == 2 and "max-batch-size" in result.output


def test_submit_prints_one_json_line_per_file(redis_url: str, start_worker: WorkerFactory,
                                              tmp_path: Path) -> None:
    start_worker()
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not really a jpeg")
    result = CliRunner().invoke(main, ["submit", "--wait", "--redis", redis_url,
                                       str(SAMPLES / "cat.jpg"), str(bad)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [Path(line["path"]).name for line in lines] == ["cat.jpg", "broken.jpg"]
    assert lines[0]["status"] == "ok" and lines[0]["output"]["label"] in CAT_LABELS
    assert lines[1]["status"] == "error" and lines[1]["error"]["code"] == "bad_image"
    # One record schema with `redbatch score` (scoring/output.py record).
    from redbatch.scoring.output import record
    assert all(set(line) == set(record("", "", line["status"], error=("x", "y"))
                                if line["status"] == "error" else record("", "", "ok"))
               for line in lines), lines
    assert lines[0]["latency_ms"] > 0 and lines[0]["batch_size"] >= 1 and lines[0]["worker"]


def test_submit_without_redis_runs_a_private_stack_and_cleans_up(tmp_path: Path) -> None:
    before_shm = shm_entries()
    mark = uuid.uuid4().hex
    # A temporary folder of the test's own (tempfile honours TMPDIR): the private server's
    # directory must be gone from it, whatever other runs make in /tmp meanwhile.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**marked_env(mark), "TMPDIR": str(tmp)}
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "submit", "--wait",
                           str(SAMPLES)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    by_name = {Path(line["path"]).name: line for line in lines}
    assert set(by_name) >= {"cat.jpg", "coffee.jpg"}
    assert by_name["cat.jpg"]["output"]["label"] in CAT_LABELS
    assert processes_with_mark(mark) == [], "no worker or pool process left"
    # redis-server rewrites its environment for its process title (so no mark to find it
    # by), which then names its port: the one the command logged is gone. Other runs'
    # servers may come and go meanwhile.
    port = re.search(r"private redis-server at redis://127\.0\.0\.1:(\d+)/",
                     proc.stderr.decode())
    assert port, proc.stderr.decode()[-2000:]
    assert not [p for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] == "redis-server"
                and re.search(rf":{port.group(1)}\b", " ".join(p.info["cmdline"] or []))], \
        "the private redis-server was stopped"
    assert shm_entries() <= before_shm
    assert not list(tmp.glob("redbatch-redis-*")), "temp dir removed"


def test_worker_with_an_unknown_model_exits_with_a_message(redis_url: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "worker", "--redis",
                           redis_url, "--model", "no_such_model"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "unknown model 'no_such_model'" in proc.stderr and "Traceback" not in proc.stderr


def test_without_redis_server_installed_the_command_says_how_to_get_one(tmp_path: Path) -> None:
    env = {**marked_env(uuid.uuid4().hex), "PATH": str(tmp_path)}  # no redis-server on it
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "score", str(SAMPLES),
                           "-o", str(tmp_path / "out.jsonl")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "redis-server was not found" in proc.stderr and "apt-get install" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_bad_worker_name_is_one_line(redis_url: str) -> None:
    for option in ("--prefix", "--model-name"):
        run = subprocess.run([sys.executable, "-m", "redbatch.cli", "worker", "--redis",
                              redis_url, option, "a b", "--metrics-port", "0"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert run.stderr.strip().splitlines()[-1].startswith("Error: invalid"), run.stderr


def test_a_refusal_from_redis_during_score_is_one_line(redis_url: str, r: object,
                                                       tmp_path: Path) -> None:
    # A user Redis lets connect but not run the admission function (an ACL written by hand).
    import redis as redis_py

    admin = redis_py.Redis.from_url(redis_url)
    user = f"no-scripts-{uuid.uuid4().hex[:6]}"
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                      commands=["+@all", "-fcall", "-fcall_ro", "-eval", "-evalsha"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@")
        run = subprocess.run([sys.executable, "-m", "redbatch.cli", "score",
                              str(SAMPLES), "-o", str(tmp_path / "out.jsonl"), "--redis", url],
                             capture_output=True, text=True, timeout=120)
    finally:
        admin.acl_deluser(user)
        admin.close()
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "Error: Redis refused" in run.stderr and "pw@" not in run.stderr, run.stderr


@pytest.mark.parametrize("command", [["worker"], ["status"], ["top"], ["limit"],
                                     ["dlq", "list"], ["submit"], ["score"]])
def test_every_command_says_what_it_does_without_redis(command: list[str]) -> None:
    """One rule: the worker's default URL, but submit and score, which start a private
    stack; each command's --help says which."""
    flat = " ".join(CliRunner().invoke(main, [*command, "--help"]).output.split())
    private = command[0] in ("submit", "score")
    assert ("a private redis-server and worker are started" in flat) is private, flat
    assert ("[default: redis://localhost:6379/0]" in flat) is not private, flat


@pytest.mark.parametrize("env, served", [
    ({}, 48),
    ({"REDBATCH_MAX_BATCH_SIZE": ""}, 48),  # what compose passes when nothing is set
    ({"REDBATCH_MAX_BATCH_SIZE": "", "REDBATCH_MAX_INFLIGHT": "", "REDBATCH_MAX_WAIT_MS": ""},
     48),
    ({"REDBATCH_MAX_BATCH_SIZE": "12"}, 12),
])
def test_an_unset_or_empty_variable_leaves_the_batch_size_to_the_profile(
        env: dict[str, str], served: int) -> None:
    # issue 27: an environment variable counts as an explicit setting, which a profile
    # never overrides; an empty one must not.
    from redbatch.gpu_worker.tuning.apply import apply_profile
    from redbatch.gpu_worker.tuning.profile import (
        Choice,
        DeviceInfo,
        Measured,
        Profile,
        Row,
        Variant,
    )

    rows = (Row(1, 10.0, 11.0, 3), Row(48, 80.0, 90.0, 3))
    profile = Profile("m", "m", "sha256:1", DeviceInfo("cpu", "x", 2), "2.13", "now",
                      {"latency_budget_ms": "auto", "max_wait_ms": 5.0},
                      (Measured(Variant(), rows, top1_agreement=1.0, samples=256),),
                      Choice(Variant(), 48, (), {1: 10.0, 48: 80.0}))
    settings = worker_settings(env)
    assert ("max_batch_size" in settings.tune.explicit) == bool(env.get(
        "REDBATCH_MAX_BATCH_SIZE"))
    tuned = apply_profile(settings, profile).settings
    assert tuned.batch.max_batch_size == served
    assert tuned.batch.max_inflight >= 2 * served
