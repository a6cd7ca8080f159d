"""The batching policy, one trigger at a time, on a fake clock (no sleeps, no model)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from redbatch.gpu_worker.batching.batcher import Batcher, LanePolicy, LatencyEstimator
from redbatch.gpu_worker.batching.shaping import (
    ShapedBatcher,
    ShapePolicy,
    TokenLatencyEstimator,
    octave_edges,
    padded_length,
)


@dataclass
class Item:
    name: str
    arrival_s: float
    deadline_s: float | None = None
    bulk: bool = False


def fill(b: Batcher[Item], n: int, at: float, deadline: float | None = None) -> None:
    for i in range(n):
        b.add(Item(f"i{i}", at, deadline))


@pytest.mark.parametrize("max_batch, max_wait_s", [(1, 10.0), (3, 10.0), (8, 1000.0)])
def test_size_trigger_releases_a_full_batch_at_once(max_batch: int, max_wait_s: float) -> None:
    b: Batcher[Item] = Batcher(max_batch, max_wait_s)
    fill(b, max_batch - 1, at=0.0)
    assert b.pop_ready(now=0.0) == []
    b.add(Item("last", 0.0))
    batch = b.pop_ready(now=0.0)
    assert len(batch) == max_batch and len(b) == 0


@pytest.mark.parametrize("max_batch, max_wait_s", [(4, 0.005), (8, 0.1), (32, 2.0)])
def test_wait_trigger_counts_from_the_oldest_arrival(max_batch: int, max_wait_s: float) -> None:
    b: Batcher[Item] = Batcher(max_batch, max_wait_s)
    b.add(Item("old", 10.0))
    b.add(Item("new", 10.0 + max_wait_s / 2))
    assert b.pop_ready(now=10.0 + max_wait_s * 0.99) == []
    assert b.next_wakeup(now=10.0) == pytest.approx(10.0 + max_wait_s)
    batch = b.pop_ready(now=10.0 + max_wait_s)
    assert [i.name for i in batch] == ["old", "new"]


def test_deadline_trigger_leaves_room_for_the_run_time() -> None:
    run_time = {1: 0.1, 2: 0.15}
    b: Batcher[Item] = Batcher(8, max_wait_s=1000.0, run_time=lambda n: run_time[min(n, 2)])
    b.add(Item("a", 0.0, 1.0))
    b.add(Item("b", 0.0))
    # With two waiting, a batch takes 0.15 s: it must start by 0.85 to meet 1.0.
    assert b.next_wakeup(now=0.0) == pytest.approx(0.85)
    assert b.pop_ready(now=0.84) == []
    assert len(b.pop_ready(now=0.85)) == 2


def test_deadline_rule_fires_before_max_wait() -> None:
    b: Batcher[Item] = Batcher(8, max_wait_s=5.0)
    b.add(Item("a", 0.0, 0.5))
    assert b.pop_ready(now=0.49) == []
    assert len(b.pop_ready(now=0.5)) == 1


def test_queue_grows_while_the_model_is_busy() -> None:
    # The caller does not call pop_ready while a batch runs, so late arrivals join the next one.
    b: Batcher[Item] = Batcher(4, max_wait_s=0.01)
    fill(b, 1, at=0.0)
    fill(b, 2, at=0.05)  # arrived while the model was busy with a previous batch
    batch = b.pop_ready(now=0.2)
    assert len(batch) == 3


def test_a_batch_never_exceeds_max_and_keeps_fifo_order() -> None:
    b: Batcher[Item] = Batcher(3, max_wait_s=0.0)
    for i in range(7):
        b.add(Item(str(i), float(i)))
    sizes = []
    order = []
    while len(b):
        batch = b.pop_ready(now=100.0)
        assert batch, "always at least one item when due"
        sizes.append(len(batch))
        order += [i.name for i in batch]
    assert sizes == [3, 3, 1] and order == [str(i) for i in range(7)]


def test_expired_requests_are_taken_out_and_never_batched() -> None:
    b: Batcher[Item] = Batcher(8, max_wait_s=1.0)
    b.add(Item("late", 0.0, 0.2))
    b.add(Item("fine", 0.0, 5.0))
    b.add(Item("none", 0.0))
    assert [i.name for i in b.pop_expired(now=0.3)] == ["late"]
    assert [i.name for i in b.pop_ready(now=1.0)] == ["fine", "none"]


def test_empty_batcher_has_no_wakeup_and_no_batch() -> None:
    b: Batcher[Item] = Batcher(2, 0.1)
    assert b.next_wakeup(0.0) is None and b.pop_ready(0.0) == [] and b.pop_expired(0.0) == []


@pytest.mark.parametrize("max_batch, max_wait_s", [(0, 1.0), (1, -1.0)])
def test_invalid_settings_are_refused(max_batch: int, max_wait_s: float) -> None:
    with pytest.raises(ValueError):
        Batcher(max_batch, max_wait_s)


def test_latency_estimator_interpolates_and_smooths() -> None:
    est = LatencyEstimator(smoothing=0.5)
    assert est(4) == 0.0
    est.observe(2, 0.2)
    est.observe(8, 0.8)
    assert est(2) == pytest.approx(0.2)
    assert est(5) == pytest.approx(0.5)
    assert est(16) == pytest.approx(1.6)
    assert est(1) == pytest.approx(0.2)
    est.observe(2, 0.4)
    assert est(2) == pytest.approx(0.3)


# ------------------------------------------------------------------ lanes


def lanes(share: float = 0.25, bulk_wait: float = 1.0, budget: float | None = None,
          starve: float = 0.5) -> LanePolicy:
    return LanePolicy(bulk_max_wait_s=bulk_wait, bulk_share=share, bulk_batch_budget_s=budget,
                      bulk_starve_s=starve)


def test_interactive_goes_first_and_bulk_fills_the_rest() -> None:
    b: Batcher[Item] = Batcher(8, max_wait_s=0.0, lanes=lanes(share=0.25))
    for i in range(10):
        b.add(Item(f"b{i}", 0.0, bulk=True))
    for i in range(3):
        b.add(Item(f"i{i}", 0.1))
    batch = b.pop_ready(now=0.1)
    assert [i.name for i in batch] == ["i0", "i1", "i2", "b0", "b1", "b2", "b3", "b4"]


def test_bulk_is_never_starved_by_a_flood_of_interactive() -> None:
    # share 0.25 of max 8: two places for bulk once it has waited 0.5 s unserved.
    b: Batcher[Item] = Batcher(8, max_wait_s=0.0, lanes=lanes(share=0.25, starve=0.5))
    for i in range(5):
        b.add(Item(f"b{i}", 0.0, bulk=True))
    bulk_per_batch = []
    for now in (0.0, 0.2, 0.5, 0.6, 0.9, 1.0, 1.5):
        for i in range(20):  # more interactive than a batch can take, every time
            b.add(Item(f"i{now}-{i}", now))
        batch = b.pop_ready(now=now)
        assert len(batch) == 8
        bulk_per_batch.append(sum(i.bulk for i in batch))
    assert bulk_per_batch == [0, 0, 2, 0, 0, 2, 1]


def test_each_lane_has_its_own_max_wait() -> None:
    b: Batcher[Item] = Batcher(8, max_wait_s=0.01, lanes=lanes(bulk_wait=0.5))
    b.add(Item("b", 0.0, bulk=True))
    assert b.pop_ready(now=0.4) == [] and b.next_wakeup(0.0) == pytest.approx(0.5)
    b.add(Item("i", 0.4))
    assert b.next_wakeup(0.4) == pytest.approx(0.41)
    assert b.pop_ready(now=0.405) == []
    assert [i.name for i in b.pop_ready(now=0.42)] == ["i", "b"]


def test_bulk_batches_fit_the_budget_only_while_interactive_traffic_is_recent() -> None:
    run_time = {n: 0.01 * n for n in range(1, 9)}  # 10 ms per request
    b: Batcher[Item] = Batcher(8, 0.0, run_time=run_time.__getitem__,
                               lanes=lanes(share=0.125, budget=0.03, starve=100.0))
    for i in range(40):
        b.add(Item(f"b{i}", 0.0, bulk=True))
    assert len(b.pop_ready(now=1.0)) == 8, "no interactive traffic: full bulk batches"
    b.add(Item("i0", 1.0))
    batch = b.pop_ready(now=1.0)
    assert [i.name for i in batch][0] == "i0" and len(batch) == 3, "1 + bulk within 30 ms"
    assert len(b.pop_ready(now=1.5)) == 3, "bulk-only batch held to 30 ms while traffic recent"
    for i in range(4):
        b.add(Item(f"i{i + 1}", 1.6))
    assert sum(i.bulk for i in b.pop_ready(now=1.6)) == 0, "no bulk behind 40 ms of interactive"
    assert len(b.pop_ready(now=3.0)) == 8, "traffic no longer recent: full batches again"


def test_expired_requests_are_found_in_both_lanes() -> None:
    b: Batcher[Item] = Batcher(8, 1.0, lanes=lanes())
    b.add(Item("b", 0.0, 0.1, bulk=True))
    b.add(Item("i", 0.0, 0.1))
    b.add(Item("keep", 0.0, bulk=True))
    assert {i.name for i in b.pop_expired(now=0.2)} == {"b", "i"} and len(b) == 1


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_invalid_lane_policy_is_refused(share: float) -> None:
    with pytest.raises(ValueError):
        LanePolicy(bulk_share=share)


# ------------------------------------------------------------------ calibration profile


def test_seeded_estimator_uses_measured_times_from_the_first_request() -> None:
    est = LatencyEstimator(smoothing=0.5)
    est.seed({1: 0.010, 8: 0.050, 0: 9.0})  # size 0 is meaningless and ignored
    assert est(1) == pytest.approx(0.010) and est(4) == pytest.approx(0.010 + 3 * 0.040 / 7)
    b: Batcher[Item] = Batcher(8, max_wait_s=1000.0, run_time=est)
    b.add(Item("a", 0.0, deadline_s=1.0))
    # One request waits: it must start 10 ms before its deadline, as measured, not 0 ms.
    assert b.next_wakeup(now=0.0) == pytest.approx(0.990)
    est.observe(1, 0.030)  # later observations move the seed as usual
    assert est(1) == pytest.approx(0.020)


def test_batches_round_up_to_a_preferred_size_only_when_no_slower() -> None:
    times = {1: 0.010, 6: 0.040, 7: 0.060, 8: 0.050, 15: 0.090, 16: 0.120}
    est = LatencyEstimator()
    est.seed(times)
    b: Batcher[Item] = Batcher(16, 0.0, run_time=est, preferred_sizes=[8, 16])
    assert b.run_size(7) == 8, "8 measured faster than 7"
    assert b.run_size(6) == 6, "6 is faster than 8: no padding"
    assert b.run_size(8) == 8 and b.run_size(15) == 15, "16 is slower than 15"
    assert b.run_size(1) == 1
    b.set_limit(7)
    assert b.run_size(7) == 7, "never past the current limit"


def test_always_round_up_pads_to_the_next_compiled_size() -> None:
    b: Batcher[Item] = Batcher(8, 0.0, run_time=lambda n: 0.01 * n, preferred_sizes=[1, 2, 4, 8],
                               always_round_up=True)
    assert [b.run_size(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_deadline_rule_uses_the_padded_run_time() -> None:
    times = {1: 0.010, 3: 0.300, 4: 0.100}
    b: Batcher[Item] = Batcher(4, 1000.0, run_time=lambda n: times[n], preferred_sizes=[4])
    fill(b, 3, at=0.0, deadline=1.0)
    assert b.next_wakeup(now=0.0) == pytest.approx(0.9), "3 run padded to 4: 100 ms, not 300"


def test_set_limit_caps_batches_and_never_passes_the_configured_max() -> None:
    b: Batcher[Item] = Batcher(8, max_wait_s=0.0)
    fill(b, 20, at=0.0)
    b.set_limit(3)
    assert len(b.pop_ready(now=1.0)) == 3
    b.set_limit(0)
    assert b.max_batch_size == 1 and len(b.pop_ready(now=1.0)) == 1
    b.set_limit(100)
    assert b.max_batch_size == 8 and len(b.pop_ready(now=1.0)) == 8


# ------------------------------------------------------------------ shapes (text lengths)


@dataclass
class Text:
    name: str
    arrival_s: float
    cost: int
    deadline_s: float | None = None
    bulk: bool = False
    #: Texts it holds (a JSON list of texts is a row of the model's batch each).
    rows: int = 1


def texts(b: Batcher[Text], costs: list[int], at: float, prefix: str = "t",
          deadline: float | None = None, bulk: bool = False) -> None:
    for n, cost in enumerate(costs):
        b.add(Text(f"{prefix}{n}", at, cost, deadline, bulk))


def drain(b: Batcher[Text], now: float) -> list[list[Text]]:
    """Every batch due at ``now``, as a free model with no run time would take them."""
    batches = []
    while batch := b.pop_ready(now):
        batches.append(batch)
    return batches


def test_shaped_batches_keep_the_token_budget_and_a_lone_long_request_still_fits() -> None:
    b: ShapedBatcher[Text] = ShapedBatcher(8, 0.0, ShapePolicy(max_batch_tokens=100,
                                                               edges=(256,)))
    texts(b, [30, 30, 30, 30, 10, 200], at=0.0)
    batches = drain(b, now=0.0)
    assert [[t.cost for t in batch] for batch in batches] == [[30, 30, 30], [30, 10], [200]]
    assert [b.padded_length(batch) for batch in batches] == [30, 30, 200]
    assert len(b) == 0


def test_a_list_of_texts_counts_a_row_a_text_in_the_token_budget() -> None:
    # 100 padded tokens: a list of 3 texts of 30 takes 90, so a single 30 waits for the
    # next batch; there the list of 2 would make 4 rows x 30 = 120, so it waits too (as one
    # request it would have fitted: 3 x 30 = 90).
    b: ShapedBatcher[Text] = ShapedBatcher(8, 0.0, ShapePolicy(max_batch_tokens=100,
                                                               edges=(256,)))
    b.add(Text("list3", 0.0, 30, rows=3))
    b.add(Text("one", 0.0, 30))
    b.add(Text("a", 0.0, 25))
    b.add(Text("list2", 0.0, 20, rows=2))
    b.add(Text("b", 0.0, 10))
    assert [[t.name for t in batch] for batch in drain(b, now=0.0)] == \
        [["list3"], ["one", "a"], ["list2", "b"]]


def test_buckets_keep_lengths_apart_while_both_are_busy() -> None:
    for short, long in ((10, 200), (10, 20)):  # far apart, and in adjacent buckets
        b: ShapedBatcher[Text] = ShapedBatcher(4, 0.01, ShapePolicy(10_000))
        for n in range(12):
            b.add(Text(f"{n}", n * 1e-4, short if n % 2 else long))
        first = [sorted({t.cost for t in batch}) for batch in drain(b, now=0.0)[:2]]
        assert first == [[long], [short]], "both full: one length per batch, oldest first"
    plain: Batcher[Text] = Batcher(4, 0.01)
    for n in range(12):
        plain.add(Text(f"{n}", n * 1e-4, 10 if n % 2 else 200))
    assert {t.cost for t in plain.pop_ready(now=0.0)} == {10, 200}, "size batching mixes them"


def test_a_lone_request_in_a_sparse_bucket_is_released_by_its_wait() -> None:
    # The 20s in the adjacent bucket are due at the same time: the lone 10 joins them.
    b: ShapedBatcher[Text] = ShapedBatcher(8, 0.01)
    b.add(Text("lone", 0.0, 10))
    texts(b, [20, 20, 20], at=0.0)
    b.add(Text("far", 0.0, 100))  # due too, but not adjacent: a batch of its own
    assert b.pop_ready(now=0.009) == [] and b.next_wakeup(0.0) == pytest.approx(0.01)
    batches = drain(b, now=0.01)
    assert [[t.name for t in batch] for batch in batches] == [["lone", "t0", "t1", "t2"],
                                                              ["far"]]
    assert b.padded_length(batches[0]) == 20
    # A neighbour that is not due yet is left to fill up; the lone request goes alone.
    b.add(Text("lone", 1.0, 10))
    texts(b, [20, 20, 20], at=1.005)
    assert [[t.name for t in batch] for batch in drain(b, now=1.01)] == [["lone"]]
    assert b.next_wakeup(1.01) == pytest.approx(1.015)
    assert [len(batch) for batch in drain(b, now=1.015)] == [3]


def test_deadlines_flush_each_bucket_by_its_own_2d_run_time() -> None:
    est = TokenLatencyEstimator()
    est.seed({(1, 10): 0.0011, (4, 200): 0.009})  # 1 ms + 10 us per padded token
    assert est(2, 100) == pytest.approx(0.003)
    b: ShapedBatcher[Text] = ShapedBatcher(8, 1000.0, token_run_time=est)
    texts(b, [200] * 4, at=0.0, prefix="long", deadline=1.0)
    texts(b, [10], at=0.0, prefix="short", deadline=1.0)
    # Four rows of 200 tokens take 9 ms: they must start by 0.991; one of 10, by 0.9989.
    assert b.next_wakeup(now=0.0) == pytest.approx(0.991)
    assert b.pop_ready(now=0.9905) == []
    assert [t.name for t in b.pop_ready(now=0.991)] == ["long0", "long1", "long2", "long3"]
    assert b.next_wakeup(now=0.991) == pytest.approx(0.9989)
    assert b.pop_ready(now=0.9988) == []
    assert [t.name for t in b.pop_ready(now=0.9989)] == ["short0"]


def test_token_latency_estimator_fits_rows_times_length_and_follows_observations() -> None:
    est = TokenLatencyEstimator(smoothing=0.5)
    assert est(4, 64) == 0.0
    est.observe(2, 50, 0.2)  # one size seen: through the origin
    assert est(4, 50) == pytest.approx(0.4)
    for rows, length in ((1, 10), (8, 128), (4, 32), (2, 50)) * 4:
        est.observe(rows, length, 0.002 + 1e-5 * rows * length)
    # The first figure has faded (weight 2**-16): the fit is the line the runs follow.
    assert est.coefficients() == pytest.approx((0.002, 1e-5), rel=0.05)
    assert est(16, 256) == pytest.approx(0.002 + 1e-5 * 16 * 256, rel=0.05)
    with pytest.raises(ValueError):
        TokenLatencyEstimator(smoothing=0.0)


def test_interactive_goes_first_across_buckets_and_bulk_fills_the_rest() -> None:
    b: ShapedBatcher[Text] = ShapedBatcher(8, 0.0, lanes=lanes(share=0.25, bulk_wait=0.0))
    texts(b, [200] * 3, at=0.0, prefix="B", bulk=True)  # older, but bulk, in another bucket
    texts(b, [10] * 10, at=0.05, prefix="b", bulk=True)
    texts(b, [10] * 3, at=0.1, prefix="i")
    names = [[t.name for t in batch] for batch in drain(b, now=0.1)]
    assert names[0] == ["i0", "i1", "i2", "b0", "b1", "b2", "b3", "b4"]
    assert names[1:] == [["B0", "B1", "B2"], ["b5", "b6", "b7", "b8", "b9"]]


def test_bulk_batches_keep_the_budget_by_the_2d_run_time() -> None:
    b: ShapedBatcher[Text] = ShapedBatcher(
        8, 0.0, token_run_time=lambda rows, length: 1e-4 * rows * length,
        lanes=lanes(budget=0.01, starve=100.0))
    texts(b, [20] * 20, at=0.0, prefix="b", bulk=True)
    b.add(Text("i", 0.0, 20))
    assert [t.name for t in b.pop_ready(now=0.0)] == ["i", "b0", "b1", "b2", "b3"], \
        "5 rows x 20 tokens = 10 ms"
    assert len(b.pop_ready(now=5.0)) == 8, "no recent interactive traffic: full batches"


def test_bulk_is_never_starved_by_a_flood_of_interactive_in_another_bucket() -> None:
    b: ShapedBatcher[Text] = ShapedBatcher(8, max_wait_s=0.0,
                                           lanes=lanes(share=0.25, bulk_wait=10.0, starve=0.5))
    texts(b, [200] * 20, at=0.0, prefix="b", bulk=True)
    bulk_per_batch = []
    for now in (0.0, 0.2, 0.5, 0.6, 0.9, 1.0, 1.5):
        texts(b, [10] * 20, at=now, prefix=f"i{now}-")  # more than a batch, every time
        batch = b.pop_ready(now=now)
        assert batch
        bulk_per_batch.append(sum(t.bulk for t in batch))
    assert bulk_per_batch == [0, 0, 8, 0, 0, 8, 4]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_arrivals_are_released_once_within_limits_and_waits(seed: int) -> None:
    rng = random.Random(seed)
    wait, bulk_wait, tick, max_rows, max_tokens = 0.01, 0.03, 0.001, 8, 600
    b: ShapedBatcher[Text] = ShapedBatcher(
        max_rows, wait, ShapePolicy(max_tokens, octave_edges(per_octave=2)),
        token_run_time=lambda rows, length: 1e-5 * rows * length,
        lanes=LanePolicy(bulk_max_wait_s=bulk_wait, bulk_share=0.25, bulk_starve_s=0.05,
                         bulk_batch_budget_s=0.002))
    arrivals, t = [], 0.0
    for n in range(1500):
        t += rng.expovariate(rng.choice([300.0, 3000.0]))
        deadline = t + rng.uniform(0.0, 0.05) if rng.random() < 0.2 else None
        arrivals.append(Text(str(n), t, lognormal_length(rng), deadline, rng.random() < 0.3))
    released: dict[str, float] = {}
    now, k = 0.0, 0
    while k < len(arrivals) or len(b):
        while k < len(arrivals) and arrivals[k].arrival_s <= now:
            b.add(arrivals[k])
            k += 1
        for item in b.pop_expired(now) + [i for batch in drain(b, now) for i in batch]:
            assert item.name not in released, "released once"
            released[item.name] = now
        now += tick
    assert len(released) == len(arrivals)
    for item in arrivals:
        limit = bulk_wait if item.bulk else wait
        assert released[item.name] - item.arrival_s <= limit + tick + 1e-9


def test_random_batches_never_break_the_rows_or_token_limits() -> None:
    rng = random.Random(7)
    b: ShapedBatcher[Text] = ShapedBatcher(8, 0.005, ShapePolicy(500, octave_edges()))
    for n in range(2000):
        b.add(Text(str(n), n * 1e-4, lognormal_length(rng), bulk=rng.random() < 0.3))
        for batch in drain(b, now=n * 1e-4):
            padded = len(batch) * b.padded_length(batch)
            assert len(batch) <= 8 and (padded <= 500 or len(batch) == 1)


def lognormal_length(rng: random.Random) -> int:
    return min(256, max(5, round(rng.lognormvariate(math.log(30), 0.9))))


def padding_ratio(b: Batcher[Text], rate: float, n: int = 2000) -> float:
    """Padded tokens / real tokens over every batch, for Poisson arrivals of long-tailed
    lengths and a model that takes 1 ms + 2 us per padded token (busy: no batch launched)."""
    rng = random.Random(11)
    arrivals, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        arrivals.append(Text(str(i), t, lognormal_length(rng)))
    now, free_at, k, padded, real = 0.0, 0.0, 0, 0, 0
    while k < n or len(b):
        while k < n and arrivals[k].arrival_s <= now:
            b.add(arrivals[k])
            k += 1
        batch = b.pop_ready(now) if now >= free_at else []
        if batch:
            length = max(item.cost for item in batch)
            padded += length * len(batch)
            real += sum(item.cost for item in batch)
            free_at = now + 0.001 + 2e-6 * length * len(batch)
        now += 0.0005
    return padded / real


@pytest.mark.parametrize("rate", [2000.0, 20000.0])  # model mostly idle; saturated
def test_buckets_cut_the_padding_waste_of_a_long_tailed_mix(rate: float) -> None:
    fine = padding_ratio(ShapedBatcher(32, 0.01, ShapePolicy(8192, octave_edges(per_octave=4))),
                         rate)
    powers_of_two = padding_ratio(ShapedBatcher(32, 0.01), rate)
    plain = padding_ratio(Batcher(32, 0.01), rate)
    print(f"rate {rate:g}/s: padded/real {fine:.3f} (4 edges an octave), "
          f"{powers_of_two:.3f} (powers of two), {plain:.3f} (size only)")
    assert fine < 1.2 and plain > 1.5 and fine < powers_of_two < plain


def test_invalid_shapes_and_costs_are_refused() -> None:
    for bad in (dict(max_batch_tokens=0), dict(edges=()), dict(edges=(16, 8)),
                dict(edges=(0, 8))):
        with pytest.raises(ValueError):
            ShapePolicy(**bad)  # type: ignore[arg-type]
    b: ShapedBatcher[Item] = ShapedBatcher(8, 0.01)
    with pytest.raises(ValueError):
        b.add(Item("no cost", 0.0))
    with pytest.raises(ValueError):
        padded_length([Text("zero", 0.0, 0)])
    assert ShapePolicy().edges == (8, 16, 32, 64, 128, 256) and ShapePolicy().bucket(300) == 5
