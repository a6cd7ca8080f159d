"""compose.yaml is valid Compose (official schema) and its worker command starts and serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import redis
import yaml
from conftest import SAMPLES
from redbatch.common.local_stack import stop_worker, wait_worker_ready
from redbatch.common.protocol import Keys
from redbatch.producer.client import Client

ROOT = Path(__file__).resolve().parent.parent
SHARED_SCHEMA = ROOT.parent / "shared" / "compose-spec" / "compose-spec.json"
#: A copy of the official schema (Apache-2.0, LICENSE beside it), so the check runs in a
#: checkout anywhere; where the shared one sits beside the checkout, the copy must equal it.
VENDORED_SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())  # type: ignore[no-any-return]


def test_compose_file_matches_the_official_schema() -> None:
    schema_file = SHARED_SCHEMA if SHARED_SCHEMA.exists() else VENDORED_SCHEMA
    schema = json.loads(schema_file.read_text())
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


def test_vendored_schema_is_the_official_one() -> None:
    if SHARED_SCHEMA.exists():
        assert VENDORED_SCHEMA.read_bytes() == SHARED_SCHEMA.read_bytes()
    schema = json.loads(VENDORED_SCHEMA.read_text())
    assert schema["$schema"].endswith("json-schema.org/draft-07/schema")
