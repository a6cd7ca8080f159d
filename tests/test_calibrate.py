"""`redbatch calibrate` on this CPU, and workers that load or make a profile (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
from conftest import CAT_LABELS, SAMPLES, WorkerFactory
from redbatch.common.protocol import Keys
from redbatch.gpu_worker.tuning.profile import MIN_TOP1_AGREEMENT, Row, Variant, load_profile
from redbatch.gpu_worker.tuning.sweep import batch_sizes, between_sizes, stop_reason
from redbatch.gpu_worker.tuning.variants import (
    candidate_variants,
    cpu_has_native_bf16,
    cxx_compiler_found,
    parse_variant,
)
from redbatch.producer.client import Client

PROFILE_KEYS = {"schema", "model", "model_spec", "fingerprint", "device", "torch_version",
                "created_utc", "settings", "variants", "choice"}


def calibrate(*args: str, env_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = None
    if env_dir is not None:
        import os

        env = {**os.environ, "REDBATCH_PROFILE_DIR": str(env_dir)}
    return subprocess.run([sys.executable, "-m", "redbatch.cli", "calibrate",
                           "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_sizes_and_variants() -> None:
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and batch_sizes(12) == [1, 2, 4, 8, 12]
    assert between_sizes(16) == [3, 7, 15] and between_sizes(2) == []
    import torch

    bf16 = [Variant(True, "bfloat16")] if cpu_has_native_bf16() else []
    assert candidate_variants(torch.device("cpu"), False) == [Variant(), Variant(True), *bf16]
    assert Variant(True, None, True) in candidate_variants(torch.device("cpu"), True)
    by_default = candidate_variants(torch.device("cpu"), None)
    assert (Variant(True, None, True) in by_default) == cxx_compiler_found(), \
        "compile is tried on CPU by default where inductor can build"
    assert parse_variant("channels_last+fp16") == Variant(True, "float16")
    assert parse_variant("eager") == Variant()
    for bad in ("fast", "fp16+bf16"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def rows(*rates: float) -> list[Row]:
    """Rows with these throughputs (img/s) at sizes 1, 2, 4, ..."""
    return [Row(1 << i, (1 << i) * 1000 / r, (1 << i) * 1000 / r, 3)
            for i, r in enumerate(rates)]


def test_sweep_stops_when_throughput_falls_plateaus_or_passes_the_budget() -> None:
    assert stop_reason(rows(50, 80, 90), None) == ""
    assert stop_reason(rows(50, 80, 60), None) == "", "one slow size may be noise"
    assert "fell" in stop_reason(rows(50, 80, 60, 55), None), "two in a row is not"
    assert "fell to 50%" in stop_reason(rows(50, 80, 40), None), "nor a collapse"
    assert stop_reason(rows(50, 80, 81, 81.5), None) == "", "flat for a while may rise again"
    assert "stopped growing" in stop_reason(rows(50, 80, 81, 81.5, 82), None)
    assert "budget" in stop_reason(rows(50, 80, 90), latency_budget_ms=40.0)  # 4 / 90: 44 ms


def test_calibrate_writes_a_profile_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = calibrate("--max-batch-size", "4", "--runs", "2", "--warmup-runs", "1", "--no-compile",
                     "--rounds", "2", "--latency-budget-ms", "5000", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "choice:" in proc.stdout and f"profile written to {out}" in proc.stdout
    assert "channels_last" in proc.stdout and "median_ms" in proc.stdout
    data = json.loads(out.read_text())
    assert PROFILE_KEYS <= set(data)
    assert data["model"] == "efficientnet_lite0" and data["fingerprint"].startswith("sha256:")
    assert data["device"]["kind"] == "cpu" and data["device"]["torch_threads"] >= 1
    assert data["settings"]["max_batch_cap"] == 4 and data["settings"]["latency_budget_ms"] == 5000
    names = ["eager", "channels_last"] + (["channels_last+bf16"] if cpu_has_native_bf16() else [])
    assert [v["name"] for v in data["variants"]] == names
    # Every variant's answers were compared with eager's on 256 real samples (the sample
    # photos and crops of them): channels_last keeps every top class; bf16 rounds, and is
    # chosen only if it keeps 99.5% of them.
    variants = {v["name"]: v for v in data["variants"]}
    assert all(v["samples"] == 256 for v in variants.values()), variants
    assert variants["eager"]["top1_agreement"] == 1 and variants["eager"]["output_error"] == 0
    assert variants["channels_last"]["top1_agreement"] == 1
    assert variants["channels_last"]["output_error"] < 1e-3
    assert all(v["faithful"] == (v["top1_agreement"] >= MIN_TOP1_AGREEMENT)
               for v in variants.values()), variants
    assert variants[data["choice"]["variant"]["name"]]["faithful"]
    assert "real samples" in data["choice"]["reason"]
    assert data["settings"]["allow_reduced_precision"] is False
    for v in data["variants"]:
        sizes = [r["batch_size"] for r in v["rows"]]
        assert sizes == [1, 2, 4][:len(sizes)] and sizes[:1] == [1], "at least batch 1"
        # Two rounds over the sizes after the first pass, two timed runs each.
        assert all(r["median_ms"] > 0 and r["p95_ms"] >= r["median_ms"] and r["runs"] == 4
                   for r in v["rows"])
    choice = data["choice"]
    assert 1 <= choice["max_batch_size"] <= 4
    assert choice["variant"]["name"] in names
    assert "1" in choice["latency_ms"] and choice["reason"]
    profile = load_profile(out)
    assert profile.choice.max_batch_size == choice["max_batch_size"]


def test_calibrate_takes_how_many_samples_check_the_answers() -> None:
    # bench/gpu_check.sh keeps its calibration short: a few samples, not 256.
    from redbatch.cli.calibrate import _settings, calibrate
    from redbatch.gpu_worker.tuning.calibrate import FIDELITY_SAMPLES

    for args, want in (([], FIDELITY_SAMPLES), (["--fidelity-samples", "8"], 8),
                       (["--fidelity-samples", "0"], 0)):
        ctx = calibrate.make_context("calibrate", args)
        assert _settings(ctx.params, 1).fidelity_samples == want


def test_unknown_variant_is_refused_with_a_message(tmp_path: Path) -> None:
    proc = calibrate("--variant", "turbo", "--out", str(tmp_path / "p.json"))
    assert proc.returncode == 1 and "unknown variant 'turbo'" in proc.stderr
    assert "Traceback" not in proc.stderr


def log_of(proc_index: int, tmp_path: Path) -> str:
    return (tmp_path / f"worker-{proc_index}.log").read_text(errors="replace")


def test_a_worker_loads_the_profile_and_uses_its_max_batch(
        start_worker: WorkerFactory, r: redis.Redis, redis_url: str, keys: Keys,
        tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    proc = calibrate("--max-batch", "2", "--runs", "1", "--warmup-runs", "0", "--no-compile",
                     "--rounds", "1", env_dir=profiles)
    assert proc.returncode == 0, proc.stderr
    (path,) = profiles.glob("efficientnet_lite0--cpu-*.json")
    # A max batch no default or measurement would give: seen in the results, it can only
    # have come from the profile.
    data = json.loads(path.read_text())
    data["choice"]["max_batch_size"] = 3
    path.write_text(json.dumps(data))
    start_worker("--calibrate", "load", env={"REDBATCH_PROFILE_DIR": str(profiles)})
    photos = [(SAMPLES / n).read_bytes() for n in ("cat.jpg", "coffee.jpg", "rocket.jpg")]
    with Client(redis_url) as client:
        ids = client.submit_many(photos * 6, timeout_s=300)
        results = [client.result(i, timeout_s=300) for i in ids]
    assert all(res.ok for res in results)
    sizes = {res.batch_size for res in results}
    assert max(sizes) <= 3 and 3 in sizes, sizes
    log = log_of(0, tmp_path)
    assert f"loaded profile {path}" in log and "max_batch=3" in log, log


@pytest.mark.full
def test_a_compiled_profile_is_served_from_a_package_built_once(
        start_worker: WorkerFactory, redis_url: str, tmp_path: Path) -> None:
    """A profile choosing channels_last+compile: the first worker builds the AOTInductor
    package beside the profile (one graph for batch sizes 1-2, no padding), the second
    loads it instead of compiling, and both answer the photos as the model does."""
    from redbatch.gpu_worker.device.packaged import packaged

    if not packaged(Variant(True, None, True), torch.device("cpu")):
        pytest.skip("this torch makes no AOTInductor packages")
    profiles = tmp_path / "compiled-profiles"
    proc = calibrate("--max-batch", "2", "--runs", "1", "--warmup-runs", "0", "--no-compile",
                     "--rounds", "1", "--variant", "channels_last", env_dir=profiles)
    assert proc.returncode == 0, proc.stderr
    (path,) = profiles.glob("efficientnet_lite0--cpu-*.json")
    data = json.loads(path.read_text())
    data["choice"]["variant"] = Variant(True, None, True).to_dict()
    path.write_text(json.dumps(data))
    env = {"REDBATCH_PROFILE_DIR": str(profiles)}
    photos = [(SAMPLES / n).read_bytes() for n in ("cat.jpg", "coffee.jpg", "rocket.jpg")]
    labels = []
    for i in range(2):
        worker = start_worker("--calibrate", "load", env=env)
        with Client(redis_url) as client:
            results = client.results(client.submit_many(photos * 2, timeout_s=300), 300)
        labels.append([res.output["label"] for res in results])
        worker.terminate()
        worker.wait(60)
        log = log_of(i, tmp_path)
        assert "variant=channels_last+compile preferred_batch_sizes=[]" in log, log
    assert "built compiled package" in log_of(0, tmp_path)
    assert "loaded compiled package" in log_of(1, tmp_path)
    assert "built compiled package" not in log_of(1, tmp_path)
    assert len(list(profiles.glob("*.so"))) == 1
    assert labels[0] == labels[1] and labels[0][0] in CAT_LABELS, labels


@pytest.mark.full
def test_calibrate_auto_measures_and_stores_a_profile(
        start_worker: WorkerFactory, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    profiles = tmp_path / "auto-profiles"
    start_worker("--calibrate", "auto", "--max-batch-size", "2", "--no-compile",
                 env={"REDBATCH_PROFILE_DIR": str(profiles)})
    (path,) = profiles.glob("efficientnet_lite0--cpu-*.json")
    profile = load_profile(path)
    assert profile.settings["quick"] and profile.settings["max_batch_cap"] == 2
    assert profile.choice.max_batch_size <= 2
    with Client(redis_url) as client:
        assert client.predict((SAMPLES / "cat.jpg").read_bytes(), timeout_s=120).ok
    deadline = time.monotonic() + 10
    while "calibrated and stored profile" not in log_of(0, tmp_path) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    log = log_of(0, tmp_path)
    assert f"calibrated and stored profile {path}" in log, log
    assert "max_batch=2 " in log, "the explicit max batch wins over the profile's"


def test_calibrate_off_loads_nothing(start_worker: WorkerFactory, r: redis.Redis,
                                     tmp_path: Path) -> None:
    profiles = tmp_path / "none"
    start_worker("--calibrate", "off", env={"REDBATCH_PROFILE_DIR": str(profiles)})
    assert not profiles.exists()
    assert "calibration off" in log_of(0, tmp_path)


def test_calibration_samples_are_the_photos_and_repeatable_crops_of_them() -> None:
    """The samples calibration judges answers on: the sample photos first, then distinct
    crops that decode as JPEGs, the same bytes on every call (two calibrations judge on the
    same inputs)."""
    import io

    from PIL import Image
    from redbatch.common.config import LimitSettings
    from redbatch.handlers.imagenet import EfficientNetLite0
    from redbatch.handlers.samples import augmented_photos

    photos = sorted(p.read_bytes() for p in SAMPLES.glob("*.jpg"))
    samples = augmented_photos(40)
    assert sorted(samples[:3]) == photos and samples == augmented_photos(40)
    assert len(set(samples)) == 40 and augmented_photos(40, seed=1) != samples
    sizes = {Image.open(io.BytesIO(s)).size for s in samples[3:]}
    assert len(sizes) > 30, "crops of many sizes"
    pairs = EfficientNetLite0(LimitSettings()).calibration_samples(5)
    assert [c for _, c in pairs] == ["image/jpeg"] * 5 and [p for p, _ in pairs] == samples[:5]


def test_a_variant_that_hangs_ends_calibration_with_one_line_and_code_3(tmp_path: Path) -> None:
    # issue 27: `redbatch calibrate` sat for ever in a deadlocked run. Each run is now
    # bounded (--warmup-timeout-s): a stuck one ends it, naming the variant and size.
    import os

    out = tmp_path / "p.json"
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-m", "redbatch.cli", "calibrate", "--device", "cpu",
         "--model", "handlers_for_tests:hangs_under_autocast", "--variant", "eager",
         "--variant", "bf16", "--max-batch-size", "2", "--runs", "1", "--warmup-runs", "0",
         "--rounds", "1", "--warmup-timeout-s", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": tests})
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "Error: calibration hung: calibration, bf16 at batch 1 did not return within 3 s "
        "(--warmup-timeout-s); the device or torch is stuck"], proc.stderr
    assert "eager" in proc.stdout and not out.exists()
