"""The default latency budget (gpu_worker/tuning/latency.py): its queue simulation against
queueing theory, and the budgets it gives for tables shaped like a GPU's and a CPU's."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from redbatch.cli import main
from redbatch.common.config import TuneSettings, parse_latency_budget
from redbatch.gpu_worker.tuning.choosing import choose
from redbatch.gpu_worker.tuning.latency import (
    batch_latency,
    default_sizes,
    fitted_line,
    p99_at_load,
    sojourns,
)
from redbatch.gpu_worker.tuning.profile import Measured, Row, Variant


def table(ms_by_size: dict[int, float], lanes: int = 1) -> tuple[Row, ...]:
    return tuple(Row(size, ms, ms * 1.1, 5, None, lanes)
                 for size, ms in sorted(ms_by_size.items()))


def test_batch_one_is_the_textbook_queue() -> None:
    """One lane, batch 1, fixed 10 ms: an M/D/1 queue, whose mean time in system at load
    0.8 is S + rho S / (2 (1 - rho)) = 3 S (Pollaczek-Khinchine)."""
    latency = batch_latency(table({1: 10.0}), padded=False)
    times = sojourns(latency, 1, 5.0, lanes=1, load=0.8)
    assert np.mean(times[len(times) // 10:]) == pytest.approx(30.0, rel=0.06)
    assert 8 * 10 < p99_at_load(latency, 1, 5.0, lanes=1) < 14 * 10


def test_a_flat_table_allows_large_batches_and_a_linear_one_does_not() -> None:
    # GPU-like: a batch of 64 takes barely longer than one image.
    gpu = table({1: 5.0, 2: 5.1, 4: 5.2, 8: 5.5, 16: 6.0, 32: 7.5, 64: 10.0})
    sizes, words = default_sizes(gpu, max_wait_ms=2.0, padded=False)
    assert sizes is not None and max(sizes) >= 16 and "default latency budget" in words
    # CPU-like: time grows with the batch, and batching gains only 10% capacity.
    cpu = table({1: 10.0, 2: 19.0, 4: 37.0, 8: 73.0, 16: 145.0}, lanes=2)
    sizes, _ = default_sizes(cpu, max_wait_ms=5.0, padded=False)
    assert sizes is not None and max(sizes) <= 2


def test_the_budget_is_the_same_for_the_same_table() -> None:
    rows = table({1: 14.2, 2: 21.1, 4: 31.8, 8: 60.9, 16: 119.4, 32: 239.2}, lanes=2)
    assert default_sizes(rows, 5.0, True) == default_sizes(rows, 5.0, True)


def test_auto_bounds_the_choice_where_throughput_alone_would_take_a_long_batch() -> None:
    """Measured here (EfficientNet-Lite0, channels_last+compile, 2 lanes): throughput alone
    takes batch 8 (61 ms a batch); the default budget keeps the tail at batch 1's."""
    rows = table({1: 14.2, 2: 21.1, 4: 31.8, 8: 60.9, 16: 119.4, 32: 239.2}, lanes=2)
    measured = [Measured(Variant(channels_last=True, compile=True), rows)]
    assert choose(measured).max_batch_size == 8
    auto = choose(measured, "auto")
    assert auto.max_batch_size == 4 and "default latency budget" in auto.reason
    assert choose(measured, 1000.0).max_batch_size == 8


def test_one_slow_run_does_not_widen_the_default_budget() -> None:
    """Seen here: batch 1's p95 over 7 runs was one 3.7 s first run of a compiled model.
    The bound is a batch size, so the outlier changes nothing."""
    rows = table({1: 13.3, 2: 26.8, 4: 47.2, 8: 83.0, 16: 125.0}, lanes=2)
    slow = (Row(1, 13.3, 3665.4, 7, None, 2), *rows[1:])
    variant = Variant(channels_last=True, compile=True)
    assert choose([Measured(variant, slow)], "auto").max_batch_size == \
        choose([Measured(variant, rows)], "auto").max_batch_size == 4


#: channels_last+compile of EfficientNet-Lite0 here, 2 lanes, in three calibrations.
THREE_RUNS = ({1: 14.2, 2: 21.1, 4: 31.8, 8: 60.9, 16: 119.4, 32: 239.2, 64: 482.3},
              {1: 13.3, 2: 26.8, 4: 47.2, 8: 83.0, 16: 125.0, 32: 268.4, 64: 536.5},
              {1: 14.0, 2: 27.9, 4: 33.8, 8: 65.6, 16: 137.7, 32: 277.2, 64: 506.0})


def test_the_choice_is_the_same_for_three_calibrations_tables() -> None:
    """Their batch of 4 differs by 48%: raw rows gave a budget of 1, 2 or 4; the fitted
    line gives 1, 2 and 4 each time, and the same max batch."""
    for ms in THREE_RUNS:
        measured = [Measured(Variant(channels_last=True, compile=True), table(ms, lanes=2))]
        choice = choose(measured, "auto")
        assert choice.max_batch_size == 4 and "batch sizes [1, 2, 4]" in choice.reason


def test_the_line_is_fitted_on_relative_error() -> None:
    assert fitted_line(table({1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0})) == pytest.approx((8.0, 2.0))
    assert fitted_line(table({1: 5.0})) == (5.0, 0.0)
    a, c = fitted_line(table({1: 5.0, 2: 4.9, 4: 4.8}))  # falling: a constant
    assert c == 0.0 and 4.8 < a < 5.0


def test_a_table_without_batch_one_has_no_default_budget() -> None:
    sizes, words = default_sizes(table({8: 10.0, 16: 12.0}), 5.0, False)
    assert sizes is None and "batch 1 was not measured" in words


@pytest.mark.parametrize(("text", "budget"), [("auto", "auto"), ("AUTO", "auto"), ("off", None),
                                              ("0", None), ("12.5", 12.5)])
def test_budget_words(text: str, budget: object) -> None:
    assert parse_latency_budget(text) == budget


@pytest.mark.parametrize("text", ["-1", "soon", "inf", "nan"])
def test_a_wrong_budget_is_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="expected auto, off or milliseconds"):
        parse_latency_budget(text)
    result = CliRunner().invoke(main, ["calibrate", "--latency-budget-ms", text])
    assert result.exit_code == 2 and "expected auto, off or milliseconds" in result.output
    assert "Traceback" not in result.output


def test_settings_default_to_the_rule() -> None:
    assert TuneSettings().latency_budget_ms == "auto"
    with pytest.raises(ValueError):
        TuneSettings(latency_budget_ms=0.0)
