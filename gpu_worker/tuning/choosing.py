"""Choosing from a profile's tables: the variant, the max batch size, the preferred sizes.

The rules, in order: only variants that keep the plain model's answers are eligible
(profile.py Measured.eligible); each eligible variant's max batch is the smallest size
reaching PEAK_SHARE of its best throughput among the sizes within the latency budget
(by default the one latency.py derives from the variant's own table); the variant with
the most throughput at that size wins, the plain one unless another is
MEASURABLY_FASTER. The choice's reason says all of it, in words.

Pure: no torch, no I/O, so the rules are unit-tested on synthetic tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from redbatch.common.config import DEFAULT_MAX_WAIT_MS, Budget, parse_latency_budget
from redbatch.gpu_worker.tuning.latency import default_sizes
from redbatch.gpu_worker.tuning.profile import Choice, Measured, Profile, Row, Variant

#: Share of the peak throughput that the chosen max batch must reach.
PEAK_SHARE = 0.95
#: A variant or a rounded-up batch size must be this much faster to be preferred over the
#: plain one: smaller differences are within the noise of a shared machine.
MEASURABLY_FASTER = 1.05


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    """Which of a variant's rows its max batch may be chosen from: those within a p95
    budget (ms), or among some sizes (the default budget, latency.py); no bound: all."""

    p95_ms: float | None = None
    sizes: frozenset[int] | None = None
    #: The bound in words, for the choice's reason.
    words: str = ""

    def fits(self, row: Row) -> bool:
        return (self.p95_ms is None or row.p95_ms <= self.p95_ms) and \
            (self.sizes is None or row.batch_size in self.sizes)


def variant_bound(m: Measured, budget: Budget, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                  device_kind: str = "cpu") -> Bound:
    """The bound ``budget`` puts on one variant's table."""
    if budget == "auto":
        sizes, words = default_sizes(m.rows, max_wait_ms, m.variant.pads_batches(device_kind))
        return Bound(sizes=sizes, words=words)
    return Bound(budget, None, "" if budget is None else f"p95 within {budget:g} ms")


def within_budget(rows: Sequence[Row], bound: Bound | float | None) -> list[Row]:
    """Rows within the bound, or within a p95 budget in ms (all rows without either)."""
    b = bound if isinstance(bound, Bound) else Bound(bound)
    return [r for r in rows if b.fits(r)]


def pick_max_batch(rows: Sequence[Row], latency_budget_ms: Bound | float | None = None,
                   share: float = PEAK_SHARE) -> int:
    """The smallest batch size reaching ``share`` of the peak throughput among the sizes
    within the bound (or whose p95 latency stays within ``latency_budget_ms``).

    When no size fits the budget, the smallest size measured (the best that can be done).
    Raises ValueError for an empty table.
    """
    if not rows:
        raise ValueError("no measurements to choose from")
    fitting = within_budget(rows, latency_budget_ms)
    if not fitting:
        return min(r.batch_size for r in rows)
    peak = max(r.images_per_s for r in fitting)
    return min(r.batch_size for r in fitting if r.images_per_s >= share * peak)


@dataclasses.dataclass(frozen=True, slots=True)
class Pick:
    """The winning variant, its max batch and the bound on it."""

    measured: Measured
    size: int
    bound: Bound


def pick_variant(measured: Sequence[Measured], latency_budget_ms: Budget = None,
                 share: float = PEAK_SHARE, allow_reduced_precision: bool = False,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS, device_kind: str = "cpu") -> Pick:
    """The variant with the highest throughput at its own chosen max batch, and that size,
    among the eligible ones (:meth:`Measured.eligible`).

    The first variant (the plain one) wins ties: another must be MEASURABLY_FASTER.
    """
    if not measured:
        raise ValueError("no variants measured")
    best: tuple[Pick, float] | None = None
    for m in measured:
        if not m.rows or not m.eligible(allow_reduced_precision):
            continue
        bound = variant_bound(m, latency_budget_ms, max_wait_ms, device_kind)
        size = pick_max_batch(m.rows, bound, share)
        rate = next(r.images_per_s for r in m.rows if r.batch_size == size)
        if best is None or rate > best[1] * MEASURABLY_FASTER:
            best = (Pick(m, size, bound), rate)
    if best is None:
        raise ValueError("no variant has measurements")
    return best[0]


def preferred_sizes(rows: Sequence[Row], max_batch_size: int) -> tuple[int, ...]:
    """Sizes that batches may be rounded up to: a size measured faster (by
    MEASURABLY_FASTER) than a smaller size measured, so padding a batch up to it saves
    time (e.g. 8 faster than 7 on a GPU whose kernels like multiples of 8)."""
    by_size = {r.batch_size: r.median_ms for r in rows if r.batch_size <= max_batch_size}
    return tuple(s for s in sorted(by_size)
                 if any(t < s and by_size[t] > by_size[s] * MEASURABLY_FASTER for t in by_size))


def choose(measured: Sequence[Measured], latency_budget_ms: Budget = None,
           share: float = PEAK_SHARE, extra_rows: Mapping[Variant, Sequence[Row]] | None = None,
           allow_reduced_precision: bool = False,
           max_wait_ms: float = DEFAULT_MAX_WAIT_MS, device_kind: str = "cpu") -> Choice:
    """The whole choice from the tables; ``extra_rows`` are in-between sizes (e.g. 7, 15)
    measured for one variant after the sweep, used for preferred sizes when that variant
    wins. The reason says why: the budget, the fidelity of the chosen variant and the
    faster ones left out."""
    pick = pick_variant(measured, latency_budget_ms, share, allow_reduced_precision,
                        max_wait_ms, device_kind)
    best, size = pick.measured, pick.size
    extra = (extra_rows or {}).get(best.variant, ())
    rows = sorted([*best.rows, *extra], key=lambda r: r.batch_size)
    peak = max(within_budget(best.rows, pick.bound) or best.rows,
               key=lambda r: r.images_per_s)
    budget = f", {pick.bound.words}" if pick.bound.words else ""
    reason = (f"smallest batch reaching {share:.0%} of the peak {peak.images_per_s:.1f} img/s "
              f"(batch {peak.batch_size}) of {best.variant.name}{budget}; "
              f"{best.fidelity()}" + ("" if best.faithful else
                                      " (reduced precision allowed by the operator)"))
    left_out = [f"{m.variant.name} ({m.fidelity()})" for m in measured
                if m.rows and not m.eligible(allow_reduced_precision)
                and max(r.images_per_s for r in m.rows) > peak.images_per_s]
    if left_out:
        reason += "; faster but changes answers, not chosen: " + ", ".join(left_out)
    # A compiled model has one graph per batch size: every batch is padded to a size
    # measured (and so compiled) rather than compiling new shapes while serving.
    preferred = tuple(r.batch_size for r in best.rows if r.batch_size <= size) \
        if best.variant.compile else preferred_sizes(rows, size)
    return Choice(best.variant, size, preferred, {r.batch_size: r.median_ms for r in rows},
                  reason)


def served_choice(profile: Profile, allow_reduced_precision: bool = False,
                  budget: Budget = "auto", budget_given: bool = False,
                  max_wait_ms: float = DEFAULT_MAX_WAIT_MS) -> tuple[Choice, str]:
    """The choice a worker serves, and a note when it is not the profile's own.

    The profile's choice stands when it was made under today's rules: its variant is
    still eligible (a profile written before answers were compared on real samples may
    have chosen reduced precision on random inputs alone: never served silently), under
    the same consent to reduced precision (a worker allowing it chooses among all), and
    under the latency budget the worker asks for: ``budget`` when ``budget_given``
    (a flag or variable), else the profile's own, or for a profile written before the
    default budget existed (throughput alone), ``budget``. Otherwise the choice is made
    again from the profile's tables (pure and quick: nothing is measured)."""
    chosen = next((m for m in profile.measured if m.variant == profile.choice.variant), None)
    lossy = chosen is not None and not chosen.eligible(allow_reduced_precision)
    # Reduced precision allowed here but not when the profile was chosen: it may win now.
    allowed_now = allow_reduced_precision and \
        not profile.settings.get("allow_reduced_precision", False)
    stored = stored_budget(profile)
    before_budgets = "max_wait_ms" not in profile.settings
    wanted = budget if budget_given or before_budgets else stored
    if not lossy and not allowed_now and wanted == stored:
        return profile.choice, ""
    try:
        choice = _choose_again(profile, wanted, allow_reduced_precision, max_wait_ms)
    except ValueError:  # only that variant was measured: the same, in full precision
        full = dataclasses.replace(profile.choice.variant, autocast=None)
        choice = dataclasses.replace(profile.choice, variant=full, latency_ms={},
                                     reason=f"{profile.choice.reason}; full precision")
    now = f"using {choice.variant.name}, max batch {choice.max_batch_size} from its tables"
    if lossy and chosen is not None:
        return choice, (f"the profile chose {chosen.variant.name} ({chosen.fidelity()}), "
                        f"which may change answers: {now}; `redbatch calibrate` checks every "
                        "variant on real samples, and --allow-reduced-precision accepts it")
    if allowed_now and wanted == stored:
        return choice, (f"reduced precision allowed (the profile was chosen faithful): {now} "
                        f"({choice.reason})")
    return choice, (f"the profile was chosen with latency budget {_shown(stored)}, this "
                    f"worker's is {_shown(wanted)}: {now} ({choice.reason})")


def _choose_again(profile: Profile, budget: Budget, allow: bool, max_wait_ms: float
                  ) -> Choice:
    """choose() over the profile's tables, with its in-between sizes for the variant they
    were measured for (the profile's choice)."""
    variant = profile.choice.variant
    measured = {r.batch_size: r for m in profile.measured
                if m.variant == variant for r in m.rows}
    lanes = next(iter(measured.values())).batches_at_once if measured else 1
    extra = [Row(s, ms, ms, 1, None, lanes) for s, ms in profile.choice.latency_ms.items()
             if s not in measured]
    return choose(profile.measured, budget, extra_rows={variant: extra},
                  allow_reduced_precision=allow, max_wait_ms=max_wait_ms,
                  device_kind=profile.device.kind)


def _shown(budget: Budget) -> str:
    return "off" if budget is None else "auto" if budget == "auto" else f"{budget:g} ms"


def stored_budget(profile: Profile) -> Budget:
    """The budget a profile was chosen with ("auto", ms, or None: no limit); a profile
    file with another value is refused when read (Profile.from_dict)."""
    return parse_latency_budget(str(profile.settings.get("latency_budget_ms")))
