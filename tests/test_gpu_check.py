"""bench/gpu_check.sh's dry run: the GPU machine's offline path, taken on this CPU.

The machine has python3 with torch, numpy, Pillow, msgpack, click, prometheus-client and
psutil, and no network. Here that python is this environment's base interpreter, shown
only those packages (linked from this environment's site-packages into a folder on
PYTHONPATH): redis, hiredis, the models' packages and redbatch itself must come from the
carried .gpu-pack/ and the working tree. The run has no network at all where ``unshare -n``
works (only loopback, for its redis-server).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / ".gpu-pack"
#: What the GPU machine's python holds (and what torch imports), by import name.
BASE = ("torch", "torchgen", "functorch", "numpy", "numpy.libs", "PIL", "pillow.libs",
        "msgpack", "click", "prometheus_client", "psutil", "filelock", "typing_extensions.py",
        "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec")
VERDICT = re.compile(r"^GPU CHECK (PASS|FAIL) ratio=(\S+) limit=(decode|python|redis|model)$")


def base_packages(tmp_path: Path) -> Path:
    """A folder of links to BASE in this environment's site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder = tmp_path / "base"
    folder.mkdir()
    for name in BASE:
        if (site / name).exists():
            (folder / name).symlink_to(site / name)
    return folder


def no_network() -> list[str]:
    """``unshare -n`` with loopback up, where this machine allows it; else nothing."""
    probe = ["unshare", "-n", "bash", "-c", "ip link set lo up"]
    if shutil.which("unshare") and shutil.which("ip") and \
            subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
        return ["unshare", "-n", "bash", "-c", 'ip link set lo up && exec "$@"', "-"]
    return []


def packed() -> None:
    """bench/gpu_pack.sh first when the folder is missing (it needs PyPI)."""
    if not (PACK / "wheels").is_dir() or not (PACK / "redis-server.tar.xz").is_file():
        subprocess.run(["bash", str(ROOT / "bench" / "gpu_pack.sh")], check=True, timeout=600)


# Minutes of wall time on a busy 2-core box; its steps have generous time limits (it passed at
# load averages of 9-16), so it runs beside the others in the first pass.
def test_the_dry_run_ends_with_a_verdict_and_at_most_8_files(tmp_path: Path) -> None:
    packed()
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("REDBATCH_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(PYTHON=getattr(sys, "_base_executable", sys.executable),
               PYTHONPATH=str(base_packages(tmp_path)), OUT=str(out))
    run = subprocess.run([*no_network(), "bash", str(ROOT / "bench" / "gpu_check.sh"),
                          "--cpu", "--quick"], env=env, capture_output=True, text=True,
                         timeout=900)
    lines = run.stdout.strip().splitlines()
    assert lines and VERDICT.match(lines[-1]), run.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert summary.strip().splitlines()[-1] == lines[-1]
    assert "failed steps:  none" in summary, run.stderr[-3000:]
    ratio = float(VERDICT.match(lines[-1]).group(2))  # type: ignore[union-attr]
    assert ratio > 0, summary  # end to end answered jobs, and the model alone ran
    assert re.search(r"device_error: ok .*\"exit_code\": 3", summary)
    assert re.search(r"decode only: .* \(\d+ processes, \d+% busy\)", summary), summary
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["env.txt", "results.tar.gz", "summary.txt"]
    assert "redis: Redis server" in (out / "env.txt").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    for part in ("correct", "model", "image", "decode", "plumbing", "text"):
        assert f"run/{part}.json" in names, names
    assert run.returncode == (0 if " PASS " in lines[-1] else 1)


def test_a_decode_bound_run_with_an_idle_pool_blames_the_worker() -> None:
    """Decoding only hardly faster than end to end is the pool's cores only when its
    processes were busy; idle ones waited for the worker (the first H200 run: a sixth
    busy), which is Python's part."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_verdict import limiting_part
    image, plumbing = {"jobs_per_s": 1000.0, "worker_cpu_ms": 0.5}, {"jobs_per_s": 9000.0}
    busy = {"jobs_per_s": 1100.0, "pool_busy": 0.9}
    assert limiting_part(image, busy, plumbing, 0.2) == "decode"
    assert limiting_part(image, {**busy, "pool_busy": 0.17}, plumbing, 0.2) == "python"
    assert limiting_part(image, {"jobs_per_s": 5000.0}, plumbing, 0.2) == "model"
