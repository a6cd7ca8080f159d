"""deploy/kubernetes/ validates offline against the vendored schemas of the kinds it uses
(tests/data/k8s-schemas/: Kubernetes v1.30 strict, KEDA's ScaledObject), and says what the
product needs: workers request a GPU and shared memory, the gateway runs a command that
parses, and KEDA scales on each lane's stream length (XLEN), never on the group's lag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from redbatch.cli.gateway import gateway
from redbatch.cli.worker import worker
from redbatch.common.protocol import Keys, Lane
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "data" / "k8s-schemas"
SCHEMA_OF = {("apps/v1", "Deployment"): "deployment-apps-v1.json",
             ("apps/v1", "StatefulSet"): "statefulset-apps-v1.json",
             ("v1", "Service"): "service-v1.json",
             ("v1", "Secret"): "secret-v1.json",
             ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json"}


def documents() -> list[dict[str, Any]]:
    docs = [d for path in sorted(MANIFESTS.glob("*.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs
    return docs


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def registry() -> Registry:  # type: ignore[type-arg]
    definitions = json.loads((SCHEMAS / "_definitions.json").read_text())
    return Registry().with_resource("https://kubernetes.io/api/_definitions.json",
                                    Resource.from_contents(definitions))


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_matches_its_kinds_schema(doc: dict[str, Any]) -> None:
    name = SCHEMA_OF.get((doc["apiVersion"], doc["kind"]))
    assert name, f"no vendored schema for {doc['apiVersion']} {doc['kind']}: add it"
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator(schema, registry=registry()).validate(doc)


def test_the_schemas_refuse_what_the_api_server_would() -> None:
    deployment = of_kind("Deployment")["redbatch-worker"]
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo: refused
    schema = json.loads((SCHEMAS / SCHEMA_OF[("apps/v1", "Deployment")]).read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema, registry=registry()).validate(wrong)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_workers_request_a_gpu_and_shared_memory_and_drain() -> None:
    spec = of_kind("Deployment")["redbatch-worker"]["spec"]["template"]["spec"]
    container = _container(of_kind("Deployment")["redbatch-worker"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    shm = {v["name"]: v for v in spec["volumes"]}["shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert spec["terminationGracePeriodSeconds"] > 30  # the drain takes up to 30 s
    worker.make_context("worker", container["command"][2:])  # the flags exist


def test_the_gateway_runs_a_command_that_parses_with_its_tenants_mounted() -> None:
    container = _container(of_kind("Deployment")["redbatch-gateway"])
    command = container["command"]
    assert command[:2] == ["redbatch", "gateway"]
    gateway.make_context("gateway", command[2:])
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    tenants = command[command.index("--tenants") + 1]
    assert str(Path(tenants).parent) in mounted
    service = of_kind("Service")["redbatch-gateway"]
    assert service["spec"]["selector"] == of_kind("Deployment")["redbatch-gateway"][
        "spec"]["selector"]["matchLabels"]


def test_keda_scales_the_workers_on_each_lanes_stream_length() -> None:
    (scaled,) = of_kind("ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] in of_kind("Deployment")
    worker_env = {e["name"]: e.get("value") for e in _container(
        of_kind("Deployment")[scaled["spec"]["scaleTargetRef"]["name"]])["env"]}
    keys = Keys(worker_env["REDBATCH_MODEL"])
    triggers = scaled["spec"]["triggers"]
    assert {t["metadata"]["stream"] for t in triggers} == {keys.stream(lane) for lane in Lane}
    for trigger in triggers:
        assert trigger["type"] == "redis-streams"
        # XLEN: the stream holds exactly the jobs queued or running. A group's lag reads
        # nil on a lane whose answered entries are deleted, so no consumerGroup here.
        assert "streamLength" in trigger["metadata"]
        assert "consumerGroup" not in trigger["metadata"]
        assert "lagCount" not in trigger["metadata"]
    assert scaled["spec"]["minReplicaCount"] >= 1
