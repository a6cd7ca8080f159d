"""The production stack without a Docker engine.

compose.yaml is valid Compose (official schema) with durable Redis, scalable GPU and CPU
workers and pinned images; each redbatch service's command, with its environment, starts
against a local redis-server, serves a real photo and answers /metrics; every metric the
Grafana dashboard and the Prometheus config name is one a live worker exports; and the
Prometheus and Grafana files point at the services and folders compose.yaml gives them.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import redis
import yaml
from conftest import SAMPLES, settings_free_env, worker_settings
from deploy_files import (
    GENERATION_DASHBOARD,
    PROMETHEUS_CONFIG,
    PROVISIONING,
    ROOT,
    dashboard_queries,
    exposition_series,
    gateway_service,
    host_path,
    label_values,
    load_compose,
    load_dashboards,
    metric_names,
    rate_arguments,
    redbatch_services,
    service_env,
    sweep_service,
)
from redbatch.cli.local_stack import stop_worker, wait_worker_ready
from redbatch.common.config import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MAX_WAIT_MS,
    GENERATION_MODELS,
    LimitSettings,
    check_redis_url,
    cluster_nodes,
    is_cluster_url,
)
from redbatch.common.protocol import Keys
from redbatch.common.redis_io import connect, is_cluster
from redbatch.gpu_worker.tuning.calibrate import DEFAULT_CAP
from redbatch.handlers.base import load_handler
from redbatch.producer.client import Client

SHARED_SCHEMA = ROOT.parent / "shared" / "compose-spec" / "compose-spec.json"
#: A copy of the official schema (Apache-2.0, LICENSE beside it), so the check runs in a
#: checkout anywhere; where the shared one sits beside the checkout, the copy must equal it.
VENDORED_SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"

METRICS_PORT = "9400"  # the metrics contract's port, which Prometheus scrapes
WORKER_DRAIN_S = 30  # the worker's first SIGTERM finishes in-flight work within this
DOCKER_DEFAULT_SHM = 64 * 1024**2
#: Exported only by workers on CUDA (metrics contract); a CPU worker may leave them out.
CUDA_ONLY = {"redbatch_gpu_memory_allocated_bytes", "redbatch_gpu_memory_reserved_bytes"}


def compose_bytes(size: str | int) -> int:
    """Compose's byte values: a number, or one with b/k/kb/m/mb/g/gb (powers of 1024)."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower())
    assert m, f"not a Compose byte value: {size!r}"
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")


def compose_seconds(duration: str) -> float:
    """Compose's durations, e.g. 40s, 1m30s, 1500ms."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


# ----------------------------------------------------------------------- the compose file


def test_compose_file_matches_the_official_schema() -> None:
    schema_file = SHARED_SCHEMA if SHARED_SCHEMA.exists() else VENDORED_SCHEMA
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(load_compose(), schema, cls=jsonschema.Draft7Validator)


def test_vendored_schema_is_the_official_one() -> None:
    if SHARED_SCHEMA.exists():
        assert VENDORED_SCHEMA.read_bytes() == SHARED_SCHEMA.read_bytes()
    schema = json.loads(VENDORED_SCHEMA.read_text())
    assert schema["$schema"].endswith("json-schema.org/draft-07/schema")


def test_redis_service_is_durable_and_never_evicts() -> None:
    redis_service = load_compose()["services"]["redis"]
    command = " ".join(redis_service["command"])
    for setting in ("--appendonly yes", "--appendfsync everysec",
                    "--maxmemory-policy noeviction"):
        assert setting in command
    assert any(v.split(":")[1] == "/data" for v in redis_service["volumes"]), "AOF on a volume"
    assert "--maxmemory 2gb" in command, "a backlog fills Redis, not the host"
    # Healthy only once PING answers PONG, not while a large AOF is still loading.
    assert "PONG" in " ".join(redis_service["healthcheck"]["test"])


def test_every_image_is_pinned() -> None:
    for name, service in load_compose()["services"].items():
        if "build" in service:
            continue  # built here from the Dockerfile, whose base is checked in test_dockerfile
        image = service["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert re.search(r"\d", tag) and tag != "latest", f"{name}: {image} is not pinned"


def test_workers_start_after_redis_is_healthy_and_drain_on_stop() -> None:
    compose = load_compose()
    for name in redbatch_services(compose):
        service = compose["services"][name]
        if "cluster" in service.get("profiles", []):  # after the cluster is made
            assert service["depends_on"] == {
                CLUSTER_INIT: {"condition": "service_completed_successfully"}}, name
        else:
            assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert compose_seconds(service["stop_grace_period"]) > WORKER_DRAIN_S, name
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name


def test_worker_reserves_a_gpu_and_enough_shared_memory() -> None:
    service = load_compose()["services"]["worker"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    env = service_env(service)
    handler = load_handler(env["REDBATCH_MODEL"], LimitSettings())
    slot_bytes = int(np.prod(handler.input_shape)) * np.dtype(handler.input_dtype).itemsize
    slots = max(int(env.get("REDBATCH_MAX_INFLIGHT") or DEFAULT_MAX_INFLIGHT),
                int(env.get("REDBATCH_MAX_BATCH_SIZE") or DEFAULT_MAX_BATCH_SIZE))
    shm = compose_bytes(service["shm_size"])
    assert shm > DOCKER_DEFAULT_SHM and shm >= 2 * slots * slot_bytes
    # In flight by default: twice the profile's batch, which GPU calibration caps at 512.
    assert shm >= 2 * DEFAULT_CAP["cuda"] * slot_bytes


def test_workers_leave_batching_to_calibration_unless_a_variable_is_set() -> None:
    # issue 27: compose.yaml set REDBATCH_MAX_BATCH_SIZE (${...:-32}), in-flight and max
    # wait for every worker, and a variable counts as an explicit setting, which a profile
    # never overrides: the profile's batch size was never served.
    compose = load_compose()
    for name in redbatch_services(compose):
        settings = worker_settings(service_env(compose["services"][name]))
        assert settings.tune.explicit == frozenset(), name
        assert (settings.batch.max_batch_size, settings.batch.max_wait_ms,
                settings.batch.max_inflight) == (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_WAIT_MS,
                                                 DEFAULT_MAX_INFLIGHT), name
    given = load_compose({"REDBATCH_MAX_BATCH_SIZE": "48", "REDBATCH_MAX_WAIT_MS": "7"})
    for name in redbatch_services(given):
        settings = worker_settings(service_env(given["services"][name]))
        assert settings.tune.explicit == {"max_batch_size"}, name
        assert (settings.batch.max_batch_size, settings.batch.max_wait_ms) == (48, 7), name


def test_workers_can_be_scaled() -> None:
    compose = load_compose()
    for name in redbatch_services(compose):
        service = compose["services"][name]
        # A fixed name or host port would make a second replica fail to start.
        assert "container_name" not in service and "ports" not in service, name
        assert service_env(service)["REDBATCH_METRICS_PORT"] == METRICS_PORT, name
        assert METRICS_PORT in [str(p) for p in service["expose"]], name


def test_cpu_profile_is_the_worker_without_a_gpu() -> None:
    compose = load_compose()
    assert redbatch_services(compose) == ["worker", "worker-chat", "worker-cluster",
                                          "worker-cpu", "worker-text"]
    gpu, cpu = compose["services"]["worker"], compose["services"]["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and "profiles" not in gpu
    assert service_env(cpu).pop("REDBATCH_DEVICE") == "cpu"
    assert "devices" not in cpu.get("deploy", {}).get("resources", {}).get("reservations", {})
    # Everything else is the same worker: same image, command, environment and limits.
    same = {k: v for k, v in gpu.items() if k != "deploy"}
    assert {k: v for k, v in cpu.items() if k != "profiles"} == {
        **same, "environment": {**same["environment"], "REDBATCH_DEVICE": "cpu"}}


def test_text_profile_is_the_cpu_worker_serving_the_text_model() -> None:
    services = load_compose()["services"]
    cpu, text = services["worker-cpu"], services["worker-text"]
    assert text["profiles"] == ["text"]
    assert service_env(text)["REDBATCH_MODEL"] == "all_minilm_l6_v2"
    assert {k: v for k, v in text.items() if k not in ("profiles", "environment")} == \
        {k: v for k, v in cpu.items() if k not in ("profiles", "environment")}
    same = {"REDBATCH_MODEL": ""}
    assert {**service_env(text), **same} == {**service_env(cpu), **same}


def test_chat_profile_is_the_cpu_worker_serving_the_chat_model() -> None:
    """The generation worker (tests/test_generation_redis.py runs its command) as a service."""
    services = load_compose()["services"]
    cpu, chat = services["worker-cpu"], services["worker-chat"]
    assert chat["profiles"] == ["chat"]
    assert service_env(chat)["REDBATCH_MODEL"] in GENERATION_MODELS
    assert {k: v for k, v in chat.items() if k not in ("profiles", "environment")} == \
        {k: v for k, v in cpu.items() if k not in ("profiles", "environment")}
    same = {"REDBATCH_MODEL": ""}
    assert {**service_env(chat), **same} == {**service_env(cpu), **same}


# ------------------------------------------------------------------ the cluster profile

CLUSTER_INIT = "redis-cluster-init"


def cluster_nodes_of(compose: dict[str, Any]) -> list[str]:
    return sorted(name for name in compose["services"] if name.startswith("redis-node-"))


def test_cluster_profile_has_six_durable_nodes_each_with_a_healthcheck() -> None:
    compose = load_compose()
    nodes = cluster_nodes_of(compose)
    assert nodes == [f"redis-node-{i}" for i in range(1, 7)]
    redis_service = compose["services"]["redis"]
    for name in nodes:
        node = compose["services"][name]
        assert node["profiles"] == ["cluster"] and node["image"] == redis_service["image"]
        command = " ".join(node["command"])
        for setting in ("--cluster-enabled yes", "--appendonly yes", "--appendfsync everysec",
                        "--maxmemory-policy noeviction", "--maxmemory 1gb"):
            assert setting in command, (name, setting)
        assert node["healthcheck"] == redis_service["healthcheck"], name
        assert node["volumes"] == [f"{name}:/data"] and name in compose["volumes"], name
        assert "ports" not in node, "reachable inside the compose network only"


def test_cluster_init_runs_once_the_nodes_are_healthy() -> None:
    compose = load_compose()
    init = compose["services"][CLUSTER_INIT]
    assert init["profiles"] == ["cluster"] and init["restart"] == "no"
    assert init["image"] == compose["services"]["redis"]["image"]
    assert init["depends_on"] == {name: {"condition": "service_healthy"}
                                  for name in cluster_nodes_of(compose)}
    assert init["entrypoint"] == ["sh", "-c"]
    script, name, *nodes = init["command"]
    assert name == CLUSTER_INIT and nodes == [f"{n}:6379" for n in cluster_nodes_of(compose)]
    assert "--cluster-replicas 1 --cluster-yes" in script


def test_cluster_worker_is_the_gpu_worker_on_the_cluster() -> None:
    compose = load_compose()
    gpu, worker = compose["services"]["worker"], compose["services"]["worker-cluster"]
    url = service_env(worker)["REDBATCH_REDIS_URL"]
    assert check_redis_url(url) == url and is_cluster_url(url)
    assert cluster_nodes(url)[1] == [(n, 6379) for n in cluster_nodes_of(compose)]
    assert worker["profiles"] == ["cluster"]
    same = {k: v for k, v in gpu.items() if k != "depends_on"}
    assert {k: v for k, v in worker.items() if k not in ("profiles", "depends_on")} == {
        **same, "environment": {**same["environment"], "REDBATCH_REDIS_URL": url}}


def test_cluster_init_command_makes_a_cluster_once() -> None:
    """The init service's script, as compose runs it (``sh -c SCRIPT NAME NODE...``), on six
    local cluster-mode redis-servers: it makes a cluster of 3 masters and 3 replicas that a
    client uses; run again, it leaves the cluster as it is and succeeds."""
    from cluster import LocalCluster

    init = load_compose()["services"][CLUSTER_INIT]
    cluster = LocalCluster(masters=3, replicas=1)
    try:
        cluster.start_nodes()
        command = [*init["entrypoint"], *init["command"][:2],
                   *[f"127.0.0.1:{node.port}" for node in cluster.nodes]]
        made = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr
        cluster.wait_ok(30)
        client = connect(cluster.url)
        assert is_cluster(client) and client.set("{m}x", b"1") and client.get("{m}x") == b"1"
        assert len(client.get_primaries()) == 3  # type: ignore[attr-defined]
        assert len(client.get_replicas()) == 3  # type: ignore[attr-defined]
        client.close()
        first = redis.Redis(port=cluster.nodes[0].port)
        before = first.execute_command("CLUSTER", "MYID")
        again = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "nothing to do" in again.stdout, again
        assert first.execute_command("CLUSTER", "MYID") == before
        assert int(first.cluster("info")["cluster_known_nodes"]) == 6
        first.close()
        cluster.wait_ok(30)
    finally:
        cluster.stop()


# ------------------------------------------------------------- the services, run locally

#: The services run here: the cluster profile's worker is the GPU worker with another URL
#: (test_cluster_worker_is_the_gpu_worker_on_the_cluster), served by no local cluster here.
#: The worker services run here as their containers would. worker-cpu in the default tier; the
#: GPU service (the same command on CPU here), the text and the chat ones only in the full tier
#: (REDBATCH_TEST_TIER=full scripts/test.sh): each start calibrates, half a minute of CPU.
LIVE_SERVICES = [name if name == "worker-cpu" else pytest.param(name, marks=pytest.mark.full)
                 for name in redbatch_services(load_compose()) if name != "worker-cluster"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    status: object = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker exited with {proc.returncode}"
        try:
            status = http_get(url, timeout_s=5)[0]
            if status == 200:
                return
        except OSError as e:
            status = e
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s}s (last: {status})")


@dataclass
class LiveService:
    name: str
    service: dict[str, Any]
    env: dict[str, str]
    metrics_url: str
    proc: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One calibration profile folder for the module: the first worker calibrates itself
    as in a fresh volume, the next one loads its profile, as a replica would."""
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module", params=LIVE_SERVICES)
def live_service(request: pytest.FixtureRequest, redis_url: str, profile_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    """A compose service's command run here as its container would run it, having served
    one photo (a text, for the text model): the container's environment, except Redis (the
    test's), device (cpu), the metrics port (a free one) and the calibration (see below)."""
    name = request.param
    service = load_compose()["services"][name]
    port = free_port()
    # The test's own profile folder, never ~/.cache; calibration without torch.compile,
    # which would take a minute per start here, and only up to batch 16 (a given max batch
    # caps it): compose leaves the batch size to it, and sizes up to 64 take minutes on a
    # busy 2-core machine.
    env = {**service_env(service), "REDBATCH_REDIS_URL": redis_url, "REDBATCH_DEVICE": "cpu",
           "REDBATCH_METRICS_PORT": str(port), "REDBATCH_METRICS_HOST": "127.0.0.1",
           "REDBATCH_PROFILE_DIR": str(profile_dir), "REDBATCH_COMPILE": "0",
           "REDBATCH_MAX_BATCH_SIZE": "16"}
    redis.Redis.from_url(redis_url).flushall()
    exe = Path(sys.executable).parent / service["command"][0]
    inherited = settings_free_env()
    log_path = tmp_path_factory.mktemp(name) / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(exe), *service["command"][1:]], env={**inherited, **env},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_worker_ready(redis_url, Keys(env["REDBATCH_MODEL"]), proc)
        wait_http_ok(f"http://127.0.0.1:{port}/readyz", proc)
        _serve_one(redis_url, env["REDBATCH_MODEL"])
        yield LiveService(name, service, env, f"http://127.0.0.1:{port}/metrics", proc)
    except BaseException:
        print(log_path.read_text(errors="replace")[-5000:])
        raise
    finally:
        assert stop_worker(proc) == 0


def _serve_one(redis_url: str, model: str) -> None:
    """One job of the kind the model takes: a chat prompt, a text, or a photo."""
    with Client(redis_url, model=model) as client:
        if model in GENERATION_MODELS:
            answer = client.generate("The capital of France is", max_new_tokens=4,
                                     timeout_s=120)
            assert answer, "an empty answer"
            return
        text = model == "all_minilm_l6_v2"
        result = (client.predict("How do I reset my password?", timeout_s=120) if text
                  else client.predict((SAMPLES / "cat.jpg").read_bytes(), timeout_s=120))
    assert result.ok, result
    assert len(result.output["embedding"]) == 384 if text \
        else isinstance(result.output["label"], str), result


def test_service_serves_and_answers_metrics(live_service: LiveService) -> None:
    status, text = http_get(live_service.metrics_url)
    assert status == 200
    assert label_values(text, "redbatch_worker_info", "model") == {
        live_service.env["REDBATCH_MODEL"]}
    assert http_get(live_service.metrics_url.replace("/metrics", "/healthz"))[0] == 200


def test_service_healthcheck_passes(live_service: LiveService) -> None:
    """The container's healthcheck command, run here: `python` is the image's interpreter."""
    kind, *command = live_service.service["healthcheck"]["test"]
    assert kind == "CMD" and command[0] == "python"
    inherited = settings_free_env()
    out = subprocess.run([sys.executable, *command[1:]], env={**inherited, **live_service.env},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def monitored_metric_names() -> dict[str, set[str]]:
    """Metric names each monitoring file refers to (dashboards and the Prometheus config)."""
    found = {name: set().union(*map(metric_names, dashboard_queries(d)))
             for name, d in load_dashboards().items()}
    found[PROMETHEUS_CONFIG.name] = metric_names(PROMETHEUS_CONFIG.read_text())
    return found


def test_monitoring_names_only_metrics_a_live_worker_exports(live_service: LiveService) -> None:
    wanted = set().union(*(names for file, names in monitored_metric_names().items()
                           if file != GENERATION_DASHBOARD))
    # Stream gauges are sampled every ~2 s after start: give them a few rounds.
    deadline = time.monotonic() + 15
    while True:
        text = http_get(live_service.metrics_url)[1]
        series, types = exposition_series(text)
        missing = wanted - series
        # Checked in the loop: a CPU worker never exports these, and waiting for them
        # would only run out the deadline.
        if label_values(text, "redbatch_worker_info", "device") <= {"cpu"}:
            missing -= CUDA_ONLY
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, f"named by the dashboard or Prometheus, not exported: {sorted(missing)}"


def test_dashboard_rates_only_counters(live_service: LiveService) -> None:
    """rate() of a gauge is a silent nonsense graph: every rate is over a counter's series."""
    series, types = exposition_series(http_get(live_service.metrics_url)[1])
    counted = {n for n, kind in types.items() if kind == "counter"}
    counted |= {n + s for n, kind in types.items() if kind in ("histogram", "summary")
                for s in ("_sum", "_count", "_bucket")}
    for dashboard in load_dashboards().values():
        for query in dashboard_queries(dashboard):
            # Names not exported at all are the test above's to report.
            assert rate_arguments(query) & series <= counted, query


# --------------------------------------------------------------- Prometheus and Grafana


def test_dashboard_shows_what_operators_need() -> None:
    names = monitored_metric_names()["redbatch.json"]
    for needed in ("redbatch_requests_total", "redbatch_request_seconds_bucket",
                   "redbatch_batch_size_bucket", "redbatch_inferences_total",
                   "redbatch_executions_total", "redbatch_stream_length",
                   "redbatch_stream_pending", "redbatch_stream_lag",
                   "redbatch_gpu_memory_allocated_bytes", "redbatch_dead_letters",
                   "redbatch_reclaimed_total", "redbatch_shm_slots_in_use",
                   "redbatch_pool_busy_processes"):
        assert needed in names, needed
    queries = dashboard_queries(load_dashboards()["redbatch.json"])
    for q in ("0.5", "0.95", "0.99"):
        assert any(f"histogram_quantile({q}, sum by (le, lane)" in e for e in queries), q
    assert any('outcome!="ok"' in e for e in queries), "errors by code"


def test_prometheus_scrapes_every_worker_service() -> None:
    compose = load_compose()
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    sd = [c for job in config["scrape_configs"] for c in job.get("dns_sd_configs", [])]
    # Type A on the service name: Docker's DNS returns every replica of a scaled service.
    targets = {(name, c["port"]) for c in sd if c.get("type", "SRV") == "A" for name in c["names"]}
    for name in redbatch_services(compose):
        env = service_env(compose["services"][name])
        assert (name, int(env["REDBATCH_METRICS_PORT"])) in targets, name
        # Workers listen on loopback unless told otherwise; Prometheus is another container.
        assert env["REDBATCH_METRICS_HOST"] == "0.0.0.0", name
    prometheus = compose["services"]["prometheus"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    assert host_path(prometheus, config_flag.split("=", 1)[1]) == PROMETHEUS_CONFIG


def test_grafana_provisions_the_datasource_and_dashboards() -> None:
    compose = load_compose()
    grafana = compose["services"]["grafana"]
    assert host_path(grafana, "/etc/grafana/provisioning") == PROVISIONING
    sources = [yaml.safe_load(p.read_text())["datasources"]
               for p in (PROVISIONING / "datasources").glob("*.yml")]
    (source,) = [s for group in sources for s in group]
    assert source["type"] == "prometheus"
    host, port = source["url"].removeprefix("http://").split(":")
    assert host in compose["services"] and int(port) == 9090

    providers = [p for f in (PROVISIONING / "dashboards").glob("*.yml")
                 for p in yaml.safe_load(f.read_text())["providers"]]
    folders = {host_path(grafana, p["options"]["path"]) for p in providers}
    dashboards = load_dashboards()
    assert dashboards and folders == {ROOT / "deploy" / "grafana" / "dashboards"}
    home = host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home is not None and home.name in dashboards

    for dashboard in dashboards.values():
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
            assert all(t["expr"] for t in panel["targets"]), panel["title"]


def test_workers_keep_profiles_and_compiled_packages_on_a_volume() -> None:
    """A recreated container finds its calibration profile and compiled package (issue 15:
    each one calibrated and compiled again): the image puts them under /var/lib/redbatch,
    owned by its user, and every worker service mounts a named volume there."""
    from test_dockerfile import dockerfile

    env = " ".join(a for op, a in dockerfile() if op == "ENV")
    assert "REDBATCH_PROFILE_DIR=/var/lib/redbatch/profiles" in env
    assert "TORCHINDUCTOR_CACHE_DIR=/var/lib/redbatch/inductor" in env
    assert any("chown redbatch /var/lib/redbatch" in a for op, a in dockerfile() if op == "RUN")
    compose = load_compose()
    for name in redbatch_services(compose):
        volumes = compose["services"][name]["volumes"]
        assert "redbatch-state:/var/lib/redbatch" in volumes, name
    assert "redbatch-state" in compose["volumes"]
    assert "REDBATCH_MODEL=/models/" in (ROOT / "compose.yaml").read_text(), \
        "a commented example of mounting your own model"


def test_the_gateway_service_runs_its_command_from_the_workers_image(redis_url: str) -> None:
    """compose's gateway: the workers' image, published on this host only, healthy once
    /healthz answers; its command with its environment (the URL pointed at a local
    redis-server) serves /healthz and /readyz."""
    compose = load_compose()
    service = gateway_service(compose)
    assert service["image"] == compose["services"]["worker"]["image"]
    assert service["build"] == compose["services"]["worker"]["build"]
    assert all(str(p).startswith(("127.0.0.1:", "${GATEWAY_PUBLISH:-127.0.0.1:"))
               for p in service["ports"]), service["ports"]
    assert "/healthz" in " ".join(service["healthcheck"]["test"])
    env = {**settings_free_env(), **service_env(service), "REDBATCH_REDIS_URL": redis_url}
    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
    port = free_port()
    command = [*service["command"], "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen([sys.executable, "-m", "redbatch.cli", *command[1:]], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/healthz", proc, timeout_s=60)
        assert http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        status, body = http_get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and json.loads(body)["object"] == "list"
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0 or proc.returncode == -15


def test_the_sweep_service_runs_its_command_and_mends_what_it_finds(redis_url: str) -> None:
    """compose's sweep: the workers' image, after a healthy Redis, always restarted; its
    command with its environment (the URL pointed at a local redis-server) deletes an
    owner key that names no job and gives one without a TTL a TTL, pass after pass, and a
    SIGTERM ends it with exit code 0."""
    compose = load_compose()
    service = sweep_service(compose)
    assert service["image"] == compose["services"]["worker"]["image"]
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["restart"] == "unless-stopped" and service["init"] is True
    r = redis.Redis.from_url(redis_url)
    keys = Keys("efficientnet_lite0")
    r.set(keys.owner("planted"), b"x" * 1000)  # no owner value, no TTL: pinned memory
    r.set(keys.owner("kept"), b"1712345678901-0 bulk")  # an owner value without a TTL
    env = {**settings_free_env(), **service_env(service), "REDBATCH_REDIS_URL": redis_url}
    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v) for k, v in env.items()}
    command = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", word) for word in service["command"]]
    assert command[2:] == ["--every", "600"]
    proc = subprocess.Popen([sys.executable, "-m", "redbatch.cli", *command[1:-1], "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (r.exists(keys.owner("planted")) or r.pttl(keys.owner("kept")) < 0) \
                and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert not r.exists(keys.owner("planted")) and r.pttl(keys.owner("kept")) > 0
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode(errors="replace")
    assert out.decode().strip(), "one JSON line a pass"
