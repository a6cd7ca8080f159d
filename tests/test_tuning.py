"""What a worker takes from its profile: precedence of flags, profile and defaults (pure)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from redbatch.common.config import BatchSettings, ModelSettings, Settings, TuneSettings
from redbatch.gpu_worker.tuning.apply import (
    apply_profile,
    find_profile,
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
    rows = (Row(1, 10.0, 11.0, 3), Row(16, 80.0, 90.0, 3))
    return Profile("m", "m", "sha256:1", DeviceInfo("cpu", "x", 2), "2.13", "now", measured,
                   (Measured(variant, rows),),
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
