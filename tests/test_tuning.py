"""What a worker takes from its profile: precedence of flags, profile and defaults (pure)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import psutil
import pytest
from conftest import WorkerFactory
from redbatch.common.config import (
    BatchSettings,
    ModelSettings,
    PoolSettings,
    Settings,
    TuneSettings,
)
from redbatch.gpu_worker.device.prepare import (
    choose_pool_processes,
    choose_torch_threads,
    cpu_lanes,
    resolve_device,
)
from redbatch.gpu_worker.tuning.apply import (
    apply_profile,
    find_profile,
    sized_pool,
    warmup_sizes,
    worth_measuring_again,
)
from redbatch.gpu_worker.tuning.profile import (
    Choice,
    DeviceInfo,
    Measured,
    Profile,
    Row,
    Variant,
    save_profile,
)

CL = Variant(channels_last=True)


def profile(variant: Variant = CL, max_batch: int = 16, preferred: tuple[int, ...] = (8,),
            **measured: object) -> Profile:
    """A profile as calibrate writes it today (its budget "auto" stands: never chosen again)."""
    rows = (Row(1, 10.0, 11.0, 3), Row(16, 80.0, 90.0, 3))
    written = {"latency_budget_ms": "auto", "max_wait_ms": 5.0, **measured}
    return Profile("m", "m", "sha256:1", DeviceInfo("cpu", "x", 2), "2.13", "now", written,
                   (Measured(variant, rows, top1_agreement=1.0, samples=256),),
                   Choice(variant, max_batch, preferred, {1: 10.0, 7: 60.0, 8: 50.0, 16: 80.0}))


def settings(*explicit: str, **batch: int) -> Settings:
    return Settings(batch=BatchSettings(**batch), tune=TuneSettings(explicit=frozenset(explicit)))


def test_profile_wins_over_defaults() -> None:
    tuned = apply_profile(settings(), profile())
    assert tuned.settings.batch.max_batch_size == 16
    assert tuned.settings.model.channels_last and tuned.variant == Variant(channels_last=True)
    assert tuned.preferred_sizes == (8,) and not tuned.always_round_up
    assert tuned.latency_s == {1: 0.010, 7: 0.060, 8: 0.050, 16: 0.080}
    assert "max_batch_size=16" in tuned.notes[0] and "channels_last=on" in tuned.notes[0]
    # interactive_reserve is recomputed for the new max batch, not kept from the default's.
    assert tuned.settings.batch.interactive_reserve == 16


def test_explicit_flags_win_over_the_profile() -> None:
    s = settings("max_batch_size", "channels_last", max_batch_size=4)
    tuned = apply_profile(s, profile())
    assert tuned.settings.batch.max_batch_size == 4 and not tuned.settings.model.channels_last
    assert any("kept over the profile" in n and "max_batch_size=4" in n for n in tuned.notes)
    # Another variant than the one measured: its times and preferred sizes do not apply.
    assert tuned.latency_s == {} and tuned.preferred_sizes == ()


def test_preferred_sizes_above_an_explicit_max_batch_are_dropped() -> None:
    s = dataclasses.replace(settings("max_batch_size", max_batch_size=6))
    tuned = apply_profile(s, profile(preferred=(8,)))
    assert tuned.settings.batch.max_batch_size == 6 and tuned.preferred_sizes == ()


def test_inflight_room_grows_with_the_profile_batch_unless_given() -> None:
    big = apply_profile(settings(), profile(max_batch=256))
    assert big.settings.batch.max_inflight == 512
    capped = apply_profile(settings("max_inflight", max_inflight=100), profile(max_batch=256))
    assert capped.settings.batch.max_batch_size == 100
    assert capped.settings.batch.max_inflight == 100


def test_a_compiled_profile_always_rounds_up() -> None:
    tuned = apply_profile(settings(), profile(Variant(True, None, True), 8, (1, 2, 4, 8)))
    assert tuned.settings.model.compile and tuned.always_round_up


def test_autocast_from_the_profile() -> None:
    tuned = apply_profile(Settings(model=ModelSettings(device="cuda")),
                          profile(Variant(True, "float16")))
    assert tuned.settings.model.autocast == "float16"


def test_unchecked_autocast_in_a_profile_is_not_served() -> None:
    """A profile that chose fp16 without checking answers on real samples (an older
    calibration): the worker serves full precision and says why, unless allowed."""
    unchecked = dataclasses.replace(profile(Variant(True, "float16")), measured=(
        Measured(Variant(True, "float16"), (Row(1, 10.0, 11.0, 3),), output_error=0.02),))
    tuned = apply_profile(Settings(model=ModelSettings(device="cuda")), unchecked)
    assert tuned.settings.model.autocast == "" and tuned.settings.model.channels_last
    assert any("may change answers" in note for note in tuned.notes), tuned.notes
    allowed = Settings(model=ModelSettings(device="cuda"),
                       tune=TuneSettings(allow_reduced_precision=True))
    assert apply_profile(allowed, unchecked).settings.model.autocast == "float16"


def test_a_profile_of_another_model_is_not_used(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    assert find_profile(path, "sha256:1")[0] is None
    save_profile(profile(), path)
    assert find_profile(path, "sha256:1")[0] is not None
    found, why = find_profile(path, "sha256:2")
    assert found is None and "another model" in why
    path.write_text("garbage")
    found, why = find_profile(path, "sha256:1")
    assert found is None and "unusable" in why


def test_warmup_sizes() -> None:
    assert warmup_sizes(8, (), cuda=False) == [1, 8]
    assert warmup_sizes(8, (4,), cuda=False) == [1, 4, 8]
    assert warmup_sizes(6, (), cuda=True) == [1, 2, 3, 4, 5, 6]
    assert warmup_sizes(100, (96,), cuda=True) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_a_doubtful_quick_profile_is_measured_again() -> None:
    assert worth_measuring_again(profile(), settings()) == "", "from redbatch calibrate: kept"
    busy = profile(quick=True, cpu_share=0.4, max_batch_cap=64)
    assert "busy machine" in worth_measuring_again(busy, settings())
    quiet = profile(quick=True, cpu_share=0.95, max_batch_cap=64)
    assert worth_measuring_again(quiet, settings()) == ""
    capped = profile(max_batch=2, quick=True, cpu_share=0.95, max_batch_cap=2)
    assert "only up to batch 2" in worth_measuring_again(capped, settings())
    assert worth_measuring_again(capped, settings("max_batch_size", max_batch_size=2)) == ""


# ------------------------------------------------------------------ the pool's size


@pytest.mark.parametrize("device, lanes, threads, cores, pool", [
    ("cuda", 1, 1, 16, 15),  # one core for the launching and collecting threads
    ("cuda", 1, 15, 16, 15),  # torch threads barely matter on CUDA
    ("cuda", 1, 1, 1, 1),
    ("cpu", 2, 1, 2, 1),  # 2 lanes x 1 thread take both cores: still one process
    ("cpu", 2, 8, 16, 5),  # the default threads take all 16: a third for the pool
    ("cpu", 2, 2, 16, 12),  # explicit threads leave 12
    ("cpu", 1, 1, 1, 1),
])
def test_the_pool_gets_the_cores_the_models_threads_leave(device: str, lanes: int,
                                                           threads: int, cores: int,
                                                           pool: int) -> None:
    assert choose_pool_processes(0, device, lanes, threads, cores) == pool
    assert choose_pool_processes(3, device, lanes, threads, cores) == 3, "given: kept"


def test_cuda_threads_take_what_the_default_pool_leaves() -> None:
    cores = os.cpu_count() or 1
    pool = choose_pool_processes(0, "cuda", 1, 1)
    assert choose_torch_threads(0, 0, "cuda") == max(1, cores - pool)
    assert choose_torch_threads(0, 1, "cuda") == max(1, cores - 1)
    assert choose_torch_threads(4, 0, "cuda") == 4


def test_sized_pool_resolves_auto_and_keeps_a_given_count() -> None:
    auto, note = sized_pool(Settings(), "cpu", 2, 8)
    assert auto.pool.processes == choose_pool_processes(0, "cpu", 2, 8) >= 1
    assert note.startswith(f"pool: {auto.pool.processes} preprocessing processes (auto on cpu")
    given, note = sized_pool(Settings(pool=PoolSettings(processes=3)), "cuda", 1, 1)
    assert given.pool.processes == 3 and note.endswith("(given)")
    with pytest.raises(ValueError):
        PoolSettings(processes=-1)


def test_a_worker_without_pool_processes_logs_and_starts_the_count_it_chose(
        start_worker: WorkerFactory, tmp_path: Path) -> None:
    kind = resolve_device("auto").type
    lanes = cpu_lanes(0) if kind == "cpu" else 1
    expected = choose_pool_processes(0, kind, lanes, choose_torch_threads(0, 0, kind, lanes))
    worker = start_worker()
    log = (tmp_path / "worker-0.log").read_text(errors="replace")
    assert f"pool: {expected} preprocessing processes (auto on {kind}" in log, log[-3000:]
    deadline = time.monotonic() + 30
    while len(pool := [p for p in psutil.Process(worker.pid).children()
                       if "spawn_main" in " ".join(p.cmdline())]) != expected:
        assert time.monotonic() < deadline, f"{len(pool)} pool processes, {expected} logged"
        time.sleep(0.2)
