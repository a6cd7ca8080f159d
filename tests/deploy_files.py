"""Reading the deployment files as Docker Compose, Prometheus and Grafana would.

No Docker engine runs where the tests do, so the tests read the files themselves:
compose.yaml with its ${VAR:-default} interpolation resolved from an empty environment
(the file's own defaults) or a given one, bind mounts mapped back to the checkout, the PromQL in the
dashboard, and a worker's /metrics text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """Compose interpolation from the variables ``env`` (none by default): `${A:-x}` gives
    x when A is unset or empty, `${A-x}` when it is unset, `${A}` A's value or "".

    `${A:?message}` (a required variable) raises when unset or empty, `${A?message}` when
    unset, as `docker compose` would fail.
    """
    env = env or {}

    def resolve(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op = m.group("name"), m.group("op") or ""
        missing = name not in env or (op.startswith(":") and not env[name])
        if op.endswith("?") and missing:
            raise ValueError(f"compose.yaml requires ${{{name}}} to be set")
        if op.endswith("-") and missing:
            return m.group("arg")
        return env.get(name, "")
    return _VARIABLE.sub(resolve, value)


def _interpolate_all(node: Any, env: Mapping[str, str] | None) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate_all(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_all(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml with YAML anchors and merge keys expanded and variables from ``env``
    (the shell or .env beside the file), by default none: at their defaults."""
    return _interpolate_all(yaml.safe_load((ROOT / "compose.yaml").read_text()), env)  # type: ignore[no-any-return]


def redbatch_services(compose: dict[str, Any]) -> list[str]:
    """Services that run a redbatch worker (built from this repo's Dockerfile); the gateway,
    from the same image, is gateway_service's."""
    return sorted(name for name, s in compose["services"].items()
                  if s.get("command", [None, None])[:2] == ["redbatch", "worker"])


def sweep_service(compose: dict[str, Any]) -> dict[str, Any]:
    """The service that runs ``redbatch sweep``."""
    (found,) = [s for s in compose["services"].values()
                if s.get("command", [None, None])[:2] == ["redbatch", "sweep"]]
    return dict(found)


def gateway_service(compose: dict[str, Any]) -> dict[str, Any]:
    """The service that runs ``redbatch gateway``."""
    (found,) = [s for s in compose["services"].values()
                if s.get("command", [None, None])[:2] == ["redbatch", "gateway"]]
    return dict(found)


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """The checkout path that a `./src:dst[:mode]` bind mount puts at container_path."""
    for volume in service.get("volumes", []):
        src, dst = volume.split(":")[:2]
        if not src.startswith("./"):
            continue
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return ROOT / src / container_path[len(dst):].lstrip("/")
    return None


#: The dashboard of chat models: its series come from a generation worker only
#: (tests/test_generation_redis.py checks them against one).
GENERATION_DASHBOARD = "redbatch-generation.json"


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL text in a dashboard: panel targets (rows included) and template queries."""
    queries = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        queries += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        queries.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return queries


METRIC_NAME = re.compile(r"\bredbatch_[A-Za-z0-9_]+")


def metric_names(text: str) -> set[str]:
    """The redbatch series names a query (or a Prometheus config) refers to."""
    return set(METRIC_NAME.findall(text))


#: Series Prometheus stores for each family type, as suffixes of the family's name.
SERIES_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def exposition_series(text: str) -> tuple[set[str], dict[str, str]]:
    """From /metrics text: every series name a query can use, and each family's type.

    A family declared with no samples yet (a labelled metric no request has touched)
    still counts: its `# TYPE` line says which series it will have.
    """
    types: dict[str, str] = {}
    series: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
            series.update(name + s for s in SERIES_SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            match = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line)
            assert match, line
            series.add(match.group())
    return series, types


def rate_arguments(query: str) -> set[str]:
    """Series given to rate(), irate() or increase(), which only make sense on counters."""
    return set(re.findall(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", query))


def label_values(text: str, metric: str, label: str) -> set[str]:
    """Values of one label across a metric's samples in /metrics text."""
    pattern = re.compile(rf'^{metric}\{{[^}}]*\b{label}="([^"]*)"', re.M)
    return set(pattern.findall(text))
