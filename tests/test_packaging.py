"""Packaging: one import namespace `redbatch`, in both editable and wheel installs; a lean base."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import SAMPLES, settings_free_env

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import importlib.util, redbatch, redbatch.common.protocol, redbatch.producer.client, "
         "redbatch.gpu_worker.batching.batcher, redbatch.handlers.decode; "
         "print(redbatch.__file__); "
         "print([m for m in ('common', 'producer', 'gpu_worker', 'preproc_worker') "
         "if importlib.util.find_spec(m)])")


def run_probe(tmp_path: Path, extra_env: dict[str, str] | None = None) -> list[str]:
    env = {**os.environ, **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.splitlines()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    return next(out.glob("redbatch-*.whl"))


def test_wheel_holds_only_the_redbatch_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"redbatch"}
    assert "redbatch/py.typed" in names
    for sub in ("common", "producer", "gpu_worker", "preproc_worker"):
        assert f"redbatch/{sub}/__init__.py" in names
    assert not any(n.startswith(("redbatch/tests", "redbatch/bench")) for n in names)


def test_every_package_folder_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = {p.parent.relative_to(ROOT) for p in ROOT.glob("*/**/__init__.py")
               if p.parts[len(ROOT.parts)] not in ("tests", "bench", "build")
               and not p.parts[len(ROOT.parts)].startswith(".")}  # .venv, .gpu-pack, ...
    missing = [str(f) for f in folders if f"redbatch/{f}/__init__.py" not in names]
    assert folders and not missing, f"add them to pyproject's packages: {missing}"


def test_wheel_install_imports_under_redbatch_only(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    location, stray = run_probe(tmp_path, {"PYTHONPATH": str(target)})
    assert location.startswith(str(target)), location
    assert stray == "[]", "no top-level common/producer modules"


def test_editable_install_imports_from_the_checkout(tmp_path: Path) -> None:
    location, stray = run_probe(tmp_path)
    assert Path(location).resolve() == ROOT / "__init__.py"
    assert stray == "[]"


def test_base_requirements_are_the_client_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    requires = meta.get_all("Requires-Dist") or []
    base = sorted(re.split(r"[<>=\[;( ]", r, maxsplit=1)[0] for r in requires
                  if "extra ==" not in r)
    assert base == ["click", "msgpack", "redis"]
    worker = " ".join(r for r in requires if "extra == \"worker\"" in r)
    for dep in ("torch", "pillow", "numpy", "prometheus-client"):
        assert dep in worker


def test_console_script_runs() -> None:
    exe = Path(sys.executable).parent / "redbatch"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "redbatch" in out.stdout


def test_the_wheel_says_its_license_and_what_it_is(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = Parser().parsestr(zf.read(next(n for n in names
                                              if n.endswith(".dist-info/METADATA"))).decode())
        licence = zf.read(next(n for n in names if n.endswith("licenses/LICENSE"))).decode()
    assert meta["License-Expression"] == "Apache-2.0" and "Apache License" in licence
    assert (ROOT / "LICENSE").read_text() == licence
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and any("Python :: 3.11" in c for c in classifiers)


@pytest.fixture(scope="module")
def client_only(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment holding the wheel and its base requirements only (as ``pip
    install redbatch`` makes one): redis, hiredis, msgpack and click are linked from this
    one (offline), and numpy, torch, Pillow and prometheus_client cannot be imported."""
    root = tmp_path_factory.mktemp("client-only")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True,
                   timeout=300)
    deps = root / "deps"
    deps.mkdir()
    for name in ("redis", "hiredis", "msgpack", "click"):
        module = __import__(name)
        assert module.__file__ is not None
        (deps / name).symlink_to(Path(module.__file__).parent)
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    (site / "client-deps.pth").write_text(f"{deps}\n")
    python = root / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = subprocess.run([str(python), "-c", "import numpy"], capture_output=True)
    assert probe.returncode != 0, "the client-only venv must not see numpy"
    return root / "venv" / "bin" / "redbatch"


def test_a_client_only_install_scores_and_says_what_a_worker_needs(
        client_only: Path, redis_url: str, start_worker: Callable[..., object],
        tmp_path: Path) -> None:
    env = settings_free_env()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(client_only), *args], env=env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=300)

    for args in (["worker", "--redis", redis_url], ["submit", str(SAMPLES / "cat.jpg")]):
        proc = run(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "pip install 'redbatch[worker]'" in proc.stderr.strip().splitlines()[-1]
    start_worker(model="null")  # from this (worker) environment
    out = tmp_path / "scores.jsonl"
    for resume in ([], ["--resume"]):  # --resume reads the output back without numpy
        proc = run("score", str(SAMPLES), "-o", str(out), "--redis", redis_url,
                   "--model", "null", *resume)
        assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and all(r["status"] == "ok" for r in records), records
