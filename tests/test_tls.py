"""TLS with client certificates, end to end: a real redis-server serving only TLS
(``--port 0 --tls-port``), a CA made here with the openssl command, and a worker, a
Client, ``redbatch score``, ``redbatch status`` and ``redbatch dlq list`` all given one
``rediss://...?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...`` URL."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import SAMPLES, TEST_MODEL, settings_free_env
from redbatch.cli.redis_server import RedisServer, TlsFiles
from redbatch.producer.client import Client
from spawned_workers import spawned_workers


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def issue(folder: Path, ca: tuple[Path, Path], name: str, extensions: str) -> tuple[Path, Path]:
    """A certificate and key for ``name`` signed by ``ca``."""
    cert, key, csr = folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}.csr"
    ext = folder / f"{name}.ext"
    ext.write_text(extensions + "\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
            "-out", cert, "-days", "2", "-extfile", ext)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder, "redbatch-test-ca")
    server = issue(folder, ca, "redis-server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                               "extendedKeyUsage=serverAuth")
    client = issue(folder, ca, "redbatch-client", "extendedKeyUsage=clientAuth")
    return TlsFiles(ca=ca[0], server_cert=server[0], server_key=server[1],
                    client_cert=client[0], client_key=client[1])


@pytest.fixture(scope="module")
def server(pki: TlsFiles) -> Iterator[RedisServer]:
    with RedisServer(tls=pki) as s:
        yield s


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = settings_free_env()
    return subprocess.run([sys.executable, "-m", "redbatch.cli", *map(str, args)],
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=300)


def test_worker_client_score_and_status_over_tls(server: RedisServer, tmp_path: Path) -> None:
    url = server.url
    assert url.startswith("rediss://") and "ssl_certfile=" in url
    with spawned_workers(tmp_path) as start:
        worker, log = start(url)
        with Client(url) as client:
            result = client.predict((SAMPLES / "cat.jpg").read_bytes(), timeout_s=120)
        assert result.ok and result.output["label"], result
        out = tmp_path / "scores.jsonl"
        scored = cli("score", SAMPLES, "-o", out, "--redis", url)
        assert scored.returncode == 0, scored.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 3 and {r["status"] for r in records} == {"ok"}
        status = cli("status", "--json", "--redis", url)
        assert status.returncode == 0, status.stderr
        assert TEST_MODEL in status.stdout and '"alive"' in status.stdout
        assert cli("dlq", "list", "--redis", url).returncode == 0
        assert worker.poll() is None
    assert "Redis not reachable" not in log.read_text(errors="replace")


def test_a_client_without_a_certificate_is_refused(server: RedisServer, pki: TlsFiles,
                                                   tmp_path: Path) -> None:
    base = f"127.0.0.1:{server.port}/0"
    no_cert = f"rediss://{base}?ssl_ca_certs={pki.ca}"
    other_ca = make_ca(tmp_path, "another-ca")
    stranger = issue(tmp_path, other_ca, "stranger", "extendedKeyUsage=clientAuth")
    wrong_ca_cert = (f"rediss://{base}?ssl_ca_certs={pki.ca}&ssl_certfile={stranger[0]}"
                     f"&ssl_keyfile={stranger[1]}")
    untrusted_server = (f"rediss://{base}?ssl_certfile={pki.client_cert}"
                        f"&ssl_keyfile={pki.client_key}")  # the system CAs: not ours
    for url in (no_cert, wrong_ca_cert, untrusted_server, f"redis://{base}"):
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        with pytest.raises(redis.ConnectionError):
            client.ping()
        client.close()
    assert redis.Redis.from_url(server.url).ping()
