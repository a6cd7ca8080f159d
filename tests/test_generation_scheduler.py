"""The generation scheduler and the KV block pool: pure policy, a fake clock, no model."""

from __future__ import annotations

import pytest
from redbatch.gpu_worker.generation.blocks import (
    BlockPool,
    block_keys,
    blocks_for,
    blocks_for_memory,
)
from redbatch.gpu_worker.generation.scheduler import (
    Finish,
    Scheduler,
    SchedulerConfig,
    SeqState,
    StepPlan,
)

EOS = 2
BS = 4


def make(budget: int = 16, running: int = 4, blocks: int = 64,
         prefix: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, running), BlockPool(blocks, BS, prefix), EOS)


def seq(name: str, prompt: int | list[int], new: int = 8, *, interactive: bool = True,
        at: float = 0.0, deadline: float | None = None) -> SeqState:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return SeqState(name, tokens, new, interactive, at, deadline)


def run(s: Scheduler, plan: StepPlan, now: float = 0.0, token: int = 7) -> list[SeqState]:
    """Complete a step as the engine would: every sampling sequence gets ``token``."""
    return s.update(plan, {i.seq.id: token for i in plan.scheduled if i.samples}, now)


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(i.seq.id, i.start, i.count) for i in plan.scheduled]


def test_a_long_prompt_is_prefilled_in_chunks_while_decodes_go_on() -> None:
    s = make(budget=8)
    s.add(seq("a", 3))
    run(s, s.schedule(0))                       # a: prompt done, first token out
    s.add(seq("long", 20))
    steps = []
    for _ in range(4):
        plan = s.schedule(0)
        steps.append(shape(plan))
        run(s, plan)
    assert steps == [[("a", 3, 1), ("long", 0, 7)], [("a", 4, 1), ("long", 7, 7)],
                     [("a", 5, 1), ("long", 14, 6)], [("a", 6, 1), ("long", 20, 1)]]
    assert [i.samples for i in s.schedule(0).scheduled] == [True, True]


def test_every_running_decode_is_scheduled_every_step() -> None:
    s = make(budget=4, running=4)
    for name in "abcd":
        s.add(seq(name, 1))
    for _ in range(4):
        run(s, s.schedule(0))
    plan = s.schedule(0)
    assert sorted(shape(plan)) == [(n, 4, 1) for n in "abcd"] and plan.tokens == 4


def test_the_budget_must_hold_every_running_decode() -> None:
    with pytest.raises(ValueError, match="max_step_tokens >= max_running"):
        SchedulerConfig(max_step_tokens=4, max_running=8)


def test_the_interactive_lane_is_admitted_first() -> None:
    s = make(budget=6)
    s.add(seq("bulk", 6, interactive=False, at=0.0))
    s.add(seq("inter", 6, interactive=True, at=1.0))
    assert shape(s.schedule(2.0)) == [("inter", 0, 6)]


def test_arrival_order_within_a_lane() -> None:
    s = make(budget=32)
    s.add(seq("late", 4, at=5.0))
    s.add(seq("early", 4, at=1.0))
    assert [n for n, _, _ in shape(s.schedule(6.0))] == ["early", "late"]


def test_max_running_bounds_the_batch() -> None:
    s = make(budget=64, running=2)
    for name in "abc":
        s.add(seq(name, 2))
    assert [n for n, _, _ in shape(s.schedule(0))] == ["a", "b"]
    assert [w.id for w in s.waiting] == ["c"]


def test_a_deadline_ends_a_waiting_or_running_sequence_before_any_compute() -> None:
    s = make()
    s.add(seq("run", 2, deadline=10.0))
    run(s, s.schedule(0.0))
    s.add(seq("wait", 2, deadline=5.0))
    s.add(seq("fine", 2))
    plan = s.schedule(10.0)
    assert sorted(x.id for x in plan.finished) == ["run", "wait"]
    assert all(x.finish is Finish.DEADLINE for x in plan.finished)
    assert shape(plan) == [("fine", 0, 2)]
    assert s.pool.used == blocks_for(2 + 8, BS)      # only "fine" holds blocks


def test_admission_reserves_prompt_and_answer_and_never_evicts() -> None:
    s = make(budget=64, blocks=6)        # 24 tokens of cache
    s.add(seq("a", 4, new=12))           # 16 tokens: 4 blocks
    s.add(seq("b", 4, new=12))           # 4 more: do not fit
    plan = s.schedule(0)
    assert shape(plan) == [("a", 0, 4)] and [w.id for w in s.waiting] == ["b"]
    for _ in range(11):
        assert not run(s, s.schedule(0))
        assert [w.id for w in s.waiting] == ["b"]       # a is never preempted
    ended = run(s, s.schedule(0))
    assert [(e.id, e.finish) for e in ended] == [("a", Finish.LENGTH)]
    assert shape(s.schedule(0)) == [("b", 0, 4)]


def test_a_head_that_does_not_fit_is_not_jumped() -> None:
    s = make(budget=64, blocks=6)
    s.add(seq("a", 4, new=12))
    run(s, s.schedule(0))
    s.add(seq("big", 4, new=12))
    s.add(seq("small", 1, new=1))
    assert [n for n, _, _ in shape(s.schedule(0))] == ["a"]


def test_eos_ends_a_sequence_and_frees_its_blocks() -> None:
    s = make()
    s.add(seq("a", 3))
    run(s, s.schedule(0))
    ended = run(s, s.schedule(1.0), token=EOS)
    assert [(e.id, e.finish, e.output) for e in ended] == [("a", Finish.STOP, [7, EOS])]
    assert s.pool.used == 0 and not s.has_work()


def test_finish_cancels_and_a_step_in_flight_is_not_recorded() -> None:
    s = make()
    s.add(seq("a", 3))
    plan = s.schedule(0)
    cancelled = s.finish("a", Finish.CANCELLED)
    assert cancelled is not None and cancelled.finish is Finish.CANCELLED
    assert run(s, plan) == [] and cancelled.output == []
    assert s.finish("a", Finish.CANCELLED) is None and s.pool.used == 0


def test_first_token_time_is_the_update_clock() -> None:
    s = make(budget=4)
    s.add(seq("a", 6, at=1.0))
    run(s, s.schedule(1.0), now=2.0)
    assert s.running[0].first_token_s is None    # two chunks: no token yet
    run(s, s.schedule(2.0), now=3.5)
    assert s.running[0].first_token_s == 3.5


def test_a_shared_prefix_is_computed_once() -> None:
    s = make(budget=64)
    system = list(range(1, 13))                   # 3 full blocks
    s.add(seq("a", system + [50, 51]))
    run(s, s.schedule(0))
    s.add(seq("b", system + [60]))
    plan = s.schedule(0)
    assert ("b", 12, 1) in shape(plan)            # starts after the 3 cached blocks
    b = next(x for x in s.running if x.id == "b")
    a = next(x for x in s.running if x.id == "a")
    assert b.reservation is not None and a.reservation is not None
    assert b.reservation.table[:3] == a.reservation.table[:3]
    assert b.reservation.cached_tokens == 12


def test_no_prefix_cache_computes_everything() -> None:
    s = make(budget=64, prefix=False)
    system = list(range(1, 13))
    s.add(seq("a", system + [50]))
    run(s, s.schedule(0))
    s.add(seq("b", system + [60]))
    assert ("b", 0, 13) in shape(s.schedule(0))


def test_the_prompt_last_token_is_always_computed() -> None:
    pool = BlockPool(16, BS)
    tokens = list(range(8))
    first = pool.reserve(tokens, 12)
    assert first is not None
    pool.register(first, tokens)
    pool.release(first)
    again = pool.reserve(tokens, 12)            # 8 tokens = 2 full blocks, 1 reused
    assert again is not None and again.cached_tokens == 4


def test_freed_cached_blocks_are_found_until_reused_least_recent_first() -> None:
    pool = BlockPool(4, BS)
    a = list(range(9))                     # 2 full blocks cached, 3 blocks used
    ra = pool.reserve(a, 9)
    assert ra is not None
    pool.register(ra, a)
    pool.release(ra)
    hit = pool.reserve(a, 9)
    assert hit is not None and hit.cached_tokens == 8 and pool.hits == 1
    pool.release(hit)
    other = pool.reserve(list(range(50, 62)), 16)   # takes all 4 blocks: evicts the keys
    assert other is not None
    pool.release(other)
    miss = pool.reserve(a, 9)
    assert miss is not None and miss.cached_tokens == 0


def test_a_reservation_that_does_not_fit_takes_nothing() -> None:
    pool = BlockPool(3, BS)
    assert pool.reserve(list(range(4)), 16) is None
    assert pool.free == 3


def test_block_keys_chain_the_whole_prefix() -> None:
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != block_keys([9, 2, 3, 4, 5, 6, 7, 8],
                                                                    4)[1]
    assert len(block_keys(list(range(11)), 4)) == 2


def test_blocks_sized_from_memory() -> None:
    assert blocks_for_memory(1000, 10, 4) == 25
    assert blocks_for_memory(1, 10, 4) == 1
    assert blocks_for(9, 4) == 3
