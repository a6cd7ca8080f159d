"""compose.yaml is valid Compose (official schema) and its worker command starts and serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import redis
import yaml
from conftest import SAMPLES
from redbatch.common.local_stack import stop_worker, wait_worker_ready
from redbatch.common.protocol import Keys
from redbatch.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT.parent / "shared" / "compose-spec" / "compose-spec.json"


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())  # type: ignore[no-any-return]


def test_compose_file_matches_the_official_schema() -> None:
    if not SCHEMA.exists():
        pytest.fail(f"Compose schema not found at {SCHEMA}")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.validate(compose(), schema, cls=jsonschema.Draft7Validator)


def test_redis_service_is_durable_and_never_evicts() -> None:
    redis_service = compose()["services"]["redis"]
    command = " ".join(redis_service["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert ":" in redis_service["image"] and not redis_service["image"].endswith(":latest")
    assert "healthcheck" in redis_service


def test_worker_service_command_starts_and_serves(redis_url: str, r: redis.Redis,
                                                  tmp_path: Path) -> None:
    service = compose()["services"]["worker"]
    env = {k: str(v) for k, v in service["environment"].items()}
    env["REDBATCH_REDIS_URL"] = redis_url  # the container would reach redis:6379
    assert service["command"][0] == "redbatch"
    exe = Path(sys.executable).parent / service["command"][0]
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen([str(exe), *service["command"][1:]], env={**os.environ, **env},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_worker_ready(redis_url, Keys(env["REDBATCH_MODEL"]), proc)
        with Client(redis_url) as client:
            assert client.predict((SAMPLES / "cat.jpg").read_bytes(), timeout_s=60).ok
    finally:
        assert stop_worker(proc) == 0
