"""Calibration profiles: the choosing rules on synthetic tables, and the file round trip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from redbatch.gpu_worker.tuning.choosing import (
    choose,
    pick_max_batch,
    pick_variant,
    preferred_sizes,
    served_choice,
)
from redbatch.gpu_worker.tuning.profile import (
    Choice,
    DeviceInfo,
    Measured,
    Profile,
    Row,
    Variant,
    load_profile,
    profile_path,
    save_profile,
)


def table(ms_by_size: dict[int, float], p95_factor: float = 1.1) -> tuple[Row, ...]:
    """Rows from median batch latencies (ms); p95 a fixed factor above."""
    return tuple(Row(size, ms, ms * p95_factor, 5) for size, ms in sorted(ms_by_size.items()))


# Throughput 100, 160, 200, 240, 250, 252 img/s: peaks at 64, 95% of it (239.4) first at 16.
GPU_LIKE = table({1: 10.0, 2: 12.5, 4: 20.0, 16: 66.67, 32: 128.0, 64: 253.97})
# CPU with glibc's default malloc: best at 4, falling after.
CPU_FALLING = table({1: 20.0, 2: 30.0, 4: 47.6, 8: 190.0, 16: 500.0})


def test_smallest_size_within_95_percent_of_the_peak() -> None:
    assert pick_max_batch(GPU_LIKE) == 16
    assert pick_max_batch(CPU_FALLING) == 4


def test_the_latency_budget_bounds_the_choice_and_the_peak() -> None:
    # p95 = 1.1 x median: batch 16 has p95 73 ms, 32 has 141 ms.
    assert pick_max_batch(GPU_LIKE, latency_budget_ms=100.0) == 16
    # Within 30 ms only 1, 2 and 4 fit: their peak is 200 img/s at 4.
    assert pick_max_batch(GPU_LIKE, latency_budget_ms=30.0) == 4
    # Nothing fits: the smallest size measured.
    assert pick_max_batch(GPU_LIKE, latency_budget_ms=1.0) == 1


@pytest.mark.parametrize("share, expected", [(1.0, 64), (0.95, 16), (0.75, 4), (0.35, 1)])
def test_share_of_the_peak_moves_the_choice(share: float, expected: int) -> None:
    assert pick_max_batch(GPU_LIKE, share=share) == expected


def test_empty_table_is_an_error() -> None:
    with pytest.raises(ValueError):
        pick_max_batch([])


def test_fastest_variant_wins_only_when_measurably_faster() -> None:
    eager = Measured(Variant(), CPU_FALLING)
    cl_faster = Measured(Variant(channels_last=True),
                         table({1: 18.0, 2: 25.0, 4: 36.0, 8: 60.0, 16: 130.0}))
    pick = pick_variant([eager, cl_faster])
    # 133 img/s at 8 against 84 eager at 4
    assert pick.measured.variant.channels_last and pick.size == 8
    barely = Measured(Variant(channels_last=True),
                      table({1: 19.9, 2: 29.9, 4: 47.0, 8: 189.0}))  # 1% faster: noise
    assert pick_variant([eager, barely]).measured.variant == Variant()


def test_preferred_sizes_are_those_faster_than_a_smaller_one() -> None:
    rows = table({4: 30.0, 7: 60.0, 8: 50.0, 15: 101.0, 16: 100.0})
    # 8 beats 7 by 20%; 16 beats 15 by only 1% (noise), so 16 is not preferred.
    assert preferred_sizes(rows, max_batch_size=16) == (8,)
    assert preferred_sizes(rows, max_batch_size=7) == ()


def test_choose_combines_the_rules_and_keeps_every_latency() -> None:
    eager = Measured(Variant(), table({1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}))
    fp16 = Measured(Variant(autocast="float16"), table({1: 8.0, 2: 9.0, 4: 11.0, 8: 30.0}),
                    top1_agreement=1.0, samples=256)
    between = table({3: 15.0, 7: 26.0})
    c = choose([eager, fp16], extra_rows={fp16.variant: between})
    # eager: 333 img/s at 8; fp16: 364 at 4 (8 slower): fp16 at 4 wins.
    assert c.variant == Variant(autocast="float16") and c.max_batch_size == 4
    assert c.latency_ms == {1: 8.0, 2: 9.0, 3: 15.0, 4: 11.0, 7: 26.0, 8: 30.0}
    assert c.preferred_batch_sizes == (4,)  # 4 (11 ms) is faster than 3 (15 ms)
    assert "fp16" in c.reason


def test_variant_names_round_trip() -> None:
    for v in (Variant(), Variant(True), Variant(True, "bfloat16", True), Variant(False, "float16")):
        assert Variant.from_dict(v.to_dict()) == v
    assert Variant(True, "float16").name == "channels_last+fp16" and Variant().name == "eager"


def sample_profile() -> Profile:
    measured = (Measured(Variant(), GPU_LIKE, "cap 64"),
                Measured(Variant(channels_last=True), CPU_FALLING, "throughput fell"))
    return Profile("efficientnet_lite0", "efficientnet_lite0", "sha256:abc",
                   DeviceInfo("cpu", "AMD EPYC", 2), "2.13.0", "2026-01-01T00:00:00Z",
                   {"latency_budget_ms": None, "max_wait_ms": 5.0, "max_batch_cap": 64, "runs": 5,
                    "quick": False},
                   measured, Choice(Variant(), 16, (8,), {1: 10.0, 16: 66.67}, "why"))


def test_profile_file_round_trip_and_documented_fields(tmp_path: Path) -> None:
    profile = sample_profile()
    path = profile_path(tmp_path, profile.model, profile.device)
    assert path.name == "efficientnet_lite0--cpu-amd-epyc-1x2t.json"
    save_profile(profile, path)
    assert load_profile(path).to_dict() == profile.to_dict()
    data = json.loads(path.read_text())
    assert {"schema", "model", "fingerprint", "device", "torch_version", "variants",
            "choice"} <= set(data)
    assert data["variants"][0]["rows"][0] == {
        "batch_size": 1, "median_ms": 10.0, "p95_ms": 11.0, "images_per_s": 100.0, "runs": 5,
        "peak_memory_bytes": None, "batches_at_once": 1}
    assert data["choice"]["max_batch_size"] == 16
    assert data["choice"]["latency_ms"] == {"1": 10.0, "16": 66.67}
    assert not list(tmp_path.glob(".*.tmp")), "written through a temporary file"


def test_another_schema_or_a_broken_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    data = sample_profile().to_dict()
    path.write_text(json.dumps({**data, "schema": 99}))
    with pytest.raises(ValueError, match="schema"):
        load_profile(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "choice"}))
    with pytest.raises(ValueError, match="malformed"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        load_profile(path)
    # Values the choice would divide by or misread: refused when read, never at serving.
    rows = data["variants"][0]["rows"]
    for broken in ({**data, "settings": {**data["settings"], "latency_budget_ms": "fast"}},
                   {**data, "variants": [{**data["variants"][0],
                                          "rows": [{**rows[0], "median_ms": 0}]}]},
                   {**data, "variants": [{**data["variants"][0], "rows": rows[::-1]}]}):
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="malformed|latency budget"):
            load_profile(path)


def test_gpu_slug_has_no_thread_count_and_cpu_slug_has_lanes() -> None:
    assert DeviceInfo("cuda", "NVIDIA H200", 16).slug == "cuda-nvidia-h200"
    assert DeviceInfo("cpu", "AMD EPYC", 1, lanes=2).slug == "cpu-amd-epyc-2x1t"


def test_throughput_counts_batches_run_at_once() -> None:
    assert Row(8, 100.0, 110.0, 3, None, batches_at_once=2).images_per_s == pytest.approx(160.0)


def test_a_compiled_choice_pads_to_every_compiled_size() -> None:
    compiled = Measured(Variant(True, None, True), table({1: 5.0, 2: 6.0, 4: 8.0, 8: 17.0}))
    c = choose([Measured(Variant(), table({1: 20.0, 2: 40.0, 4: 80.0, 8: 160.0})), compiled])
    assert c.variant.compile and c.max_batch_size == 4 and c.preferred_batch_sizes == (1, 2, 4)


def test_a_faster_variant_whose_outputs_differ_too_much_is_not_chosen() -> None:
    plain = Measured(Variant(), table({1: 20.0, 2: 40.0}), output_error=0.0,
                     top1_agreement=1.0, samples=256)
    close = Measured(Variant(True, "bfloat16"), table({1: 10.0, 2: 20.0}), output_error=0.03,
                     top1_agreement=0.996, samples=256)
    far = Measured(Variant(True, "float16"), table({1: 5.0, 2: 10.0}), output_error=0.5,
                   top1_agreement=0.5, samples=256)
    assert close.faithful and not far.faithful
    assert choose([plain, close, far]).variant == close.variant
    assert choose([plain, far]).variant == plain.variant
    assert not far.eligible(allow_reduced_precision=True), "broken (overflow): never"
    assert Measured.from_dict(far.to_dict()) == far, "the error is kept in the profile"


def test_reduced_precision_that_changes_answers_is_chosen_only_when_allowed() -> None:
    """bf16 within the distance on random inputs (2.3%) but changing the top class of 4%
    of real samples: never chosen silently; chosen with --allow-reduced-precision; and
    the reason says what was left out and why."""
    plain = Measured(Variant(), table({1: 20.0, 2: 40.0}), output_error=0.0,
                     top1_agreement=1.0, samples=256)
    compiled = Measured(Variant(compile=True), table({1: 12.0, 2: 24.0}), output_error=1e-6,
                        top1_agreement=1.0, samples=256)
    bf16 = Measured(Variant(autocast="bfloat16", compile=True), table({1: 6.0, 2: 12.0}),
                    output_error=0.023, top1_agreement=0.96, samples=256)
    assert compiled.faithful and not bf16.faithful
    choice = choose([plain, compiled, bf16])
    assert choice.variant == compiled.variant
    assert "top-1 agreement 100.0% on 256 real samples" in choice.reason
    assert "not chosen: bf16+compile (top-1 agreement 96.0% on 256 real samples" \
        in choice.reason
    allowed = choose([plain, compiled, bf16], allow_reduced_precision=True)
    assert allowed.variant == bf16.variant and "allowed by the operator" in allowed.reason
    back = Measured.from_dict(bf16.to_dict())
    assert (back.top1_agreement, back.samples, back.faithful) == (0.96, 256, False)


def test_reduced_precision_never_checked_on_real_samples_is_not_faithful() -> None:
    """A handler without samples: fp32 variants are judged by the distance on random
    inputs; reduced precision, which that cannot vouch for, only with consent."""
    plain = Measured(Variant(), table({1: 20.0}), output_error=0.0)
    cl = Measured(Variant(channels_last=True), table({1: 15.0}), output_error=1e-7)
    fp16 = Measured(Variant(autocast="float16"), table({1: 5.0}), output_error=0.01)
    overflowing = Measured(Variant(autocast="float16"), table({1: 4.0}), output_error=0.9)
    assert cl.faithful and not fp16.faithful and fp16.eligible(allow_reduced_precision=True)
    assert not overflowing.eligible(allow_reduced_precision=True)
    assert choose([plain, cl, fp16]).variant == cl.variant
    assert choose([plain, cl, fp16], allow_reduced_precision=True).variant == fp16.variant


def test_a_profile_that_chose_unchecked_reduced_precision_is_chosen_again() -> None:
    """A profile written before answers were checked on real samples chose bf16 on random
    inputs alone: the worker re-chooses from its tables and says why."""
    plain = Measured(Variant(), table({1: 20.0, 2: 40.0}), output_error=0.0)
    bf16 = Measured(Variant(autocast="bfloat16"), table({1: 6.0, 2: 12.0}), output_error=0.02)
    old = dataclasses.replace(sample_profile(), measured=(plain, bf16),
                              choice=choose([plain, bf16], allow_reduced_precision=True))
    assert old.choice.variant == bf16.variant
    choice, why = served_choice(old)
    assert choice.variant == Variant() and "may change answers" in why
    assert served_choice(old, allow_reduced_precision=True)[0] == old.choice
    # Chosen faithful, served by a worker that allows reduced precision: bf16 wins then.
    faithful = dataclasses.replace(old, choice=choice, settings={
        **old.settings, "allow_reduced_precision": False})
    assert served_choice(faithful) == (choice, "")
    allowed, why = served_choice(faithful, allow_reduced_precision=True)
    assert allowed.variant == bf16.variant and "reduced precision allowed" in why


def test_a_worker_serves_the_latency_budget_it_asks_for() -> None:
    """A profile keeps the budget it was calibrated with unless the worker is given one;
    one written before the default budget (throughput alone) gets the default."""
    rows = tuple(Row(s, ms, ms * 1.1, 5, None, 2) for s, ms in
                 {1: 14.2, 2: 21.1, 4: 31.8, 8: 60.9, 16: 119.4, 32: 239.2}.items())
    measured = (Measured(Variant(channels_last=True, compile=True), rows,
                         top1_agreement=1.0, samples=256),)
    new = dataclasses.replace(sample_profile(), measured=measured,
                              settings={"latency_budget_ms": "auto", "max_wait_ms": 5.0},
                              choice=choose(measured, "auto"))
    assert new.choice.max_batch_size == 4
    assert served_choice(new) == (new.choice, "")
    choice, why = served_choice(new, budget=None, budget_given=True)
    assert choice.max_batch_size == 8 and "this worker's is off" in why
    choice, why = served_choice(new, budget=30.0, budget_given=True)
    assert choice.max_batch_size == 2 and "this worker's is 30 ms" in why
    old = dataclasses.replace(new, settings={"latency_budget_ms": None},
                              choice=choose(measured))
    assert old.choice.max_batch_size == 8
    choice, why = served_choice(old)
    assert choice.max_batch_size == 4 and "latency budget off, this worker's is auto" in why
    assert choice.preferred_batch_sizes == (1, 2, 4)  # compiled: the sizes measured
