"""Calibration profiles: what was measured for one model on one device, and what was chosen.

A profile is a JSON file per (model, device), written by ``redbatch calibrate``
(or by a worker's own quick calibration) and read by ``redbatch worker`` at
start. It holds, per device-path variant (channels_last, autocast, compile),
the latency and throughput of each batch size measured, and the choice made
from them: the variant, the max batch size and the preferred batch sizes.

Pure: no torch, no I/O beyond reading and writing the file, so the choosing
rules are unit-tested on synthetic tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Version of the file layout; a file of another version is ignored (and re-measured).
SCHEMA = 1
#: Where profiles live when REDBATCH_PROFILE_DIR is not set: $XDG_CACHE_HOME/redbatch/profiles.
PROFILE_DIR_ENV = "REDBATCH_PROFILE_DIR"
#: Share of the peak throughput that the chosen max batch must reach.
PEAK_SHARE = 0.95
#: A variant or a rounded-up batch size must be this much faster to be preferred over the
#: plain one: smaller differences are within the noise of a shared machine.
MEASURABLY_FASTER = 1.05
#: Largest output_error a variant may have and still be chosen. bf16 and fp16 differ from
#: float32 by 1-4% on EfficientNet-Lite0; a variant that overflows, or a compiler bug,
#: differs by far more. Necessary, not sufficient: see MIN_TOP1_AGREEMENT.
MAX_OUTPUT_ERROR = 0.1
#: Share of real inputs (the handler's calibration samples) on which a variant must give
#: the plain model's top class to be chosen without the operator's consent. bf16 autocast
#: on a CPU without native bf16 was 2.3% from float32 on random tensors, well within
#: MAX_OUTPUT_ERROR, and still changed the top class of 3.8% of served photos.
MIN_TOP1_AGREEMENT = 0.995
#: Even allowed, a reduced-precision variant agreeing on fewer real samples than this is
#: broken (an overflow, a compiler bug), not rounding: bf16 agrees on 95-99% here.
LOSSY_FLOOR = 0.9


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of running the model on the device (see gpu_worker/model.py DevicePath)."""

    channels_last: bool = False
    #: "float16", "bfloat16" or None (full precision).
    autocast: str | None = None
    #: torch.compile (inductor, static shapes).
    compile: bool = False

    @property
    def name(self) -> str:
        short = {"float16": "fp16", "bfloat16": "bf16"}
        parts = (["channels_last"] if self.channels_last else []) + \
            ([short[self.autocast]] if self.autocast else []) + \
            (["compile"] if self.compile else [])
        return "+".join(parts) or "eager"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "channels_last": self.channels_last,
                "autocast": self.autocast, "compile": self.compile}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Variant:
        autocast = d.get("autocast")
        if autocast not in (None, "float16", "bfloat16"):
            raise ValueError(f"unknown autocast dtype {autocast!r}")
        return cls(bool(d.get("channels_last")), autocast, bool(d.get("compile")))


@dataclass(frozen=True, slots=True)
class Row:
    """Measured runs of one batch size: latency of a whole batch, and images per second."""

    batch_size: int
    median_ms: float
    p95_ms: float
    runs: int
    #: Device memory a run added at its peak, over what was allocated before (CUDA).
    peak_memory_bytes: int | None = None
    #: Batches of this size that ran at once (CPU lanes); the latency is of each.
    batches_at_once: int = 1

    @property
    def images_per_s(self) -> float:
        images = self.batch_size * self.batches_at_once
        return images * 1000.0 / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "median_ms": round(self.median_ms, 3),
                "p95_ms": round(self.p95_ms, 3), "images_per_s": round(self.images_per_s, 2),
                "runs": self.runs, "peak_memory_bytes": self.peak_memory_bytes,
                "batches_at_once": self.batches_at_once}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Row:
        peak = d.get("peak_memory_bytes")
        return cls(int(d["batch_size"]), float(d["median_ms"]), float(d["p95_ms"]),
                   int(d["runs"]), None if peak is None else int(peak),
                   int(d.get("batches_at_once", 1)))


@dataclass(frozen=True, slots=True)
class Measured:
    """The table of one variant, sizes ascending; ``stopped`` says why the sweep ended."""

    variant: Variant
    rows: tuple[Row, ...]
    stopped: str = ""
    #: How far its outputs are from the first variant's on the same inputs (relative L2
    #: norm of the output rows, the largest row); None: not compared.
    output_error: float | None = None
    #: Share of the real samples on which its top class (argmax of the output row) is the
    #: first variant's; None: no samples (the handler has none).
    top1_agreement: float | None = None
    #: How many real samples that share is of.
    samples: int = 0

    @property
    def faithful(self) -> bool:
        """Shown to keep the plain model's answers: on real samples, MIN_TOP1_AGREEMENT
        (the distance, large for bf16 logits, is only reported then); without any, within
        MAX_OUTPUT_ERROR on random inputs, which cannot vouch for reduced precision
        (autocast): that is never faithful unchecked."""
        if self.top1_agreement is not None:
            return self.top1_agreement >= MIN_TOP1_AGREEMENT
        close = self.output_error is None or self.output_error <= MAX_OUTPUT_ERROR
        return close and self.variant.autocast is None

    def eligible(self, allow_reduced_precision: bool = False) -> bool:
        """May be chosen: faithful, or a reduced-precision variant the operator allowed
        (``--allow-reduced-precision``) that is not broken: LOSSY_FLOOR agreement on real
        samples, or within MAX_OUTPUT_ERROR on random inputs."""
        if self.faithful:
            return True
        if not allow_reduced_precision or self.variant.autocast is None:
            return False
        if self.top1_agreement is not None:
            return self.top1_agreement >= LOSSY_FLOOR
        return self.output_error is None or self.output_error <= MAX_OUTPUT_ERROR

    def fidelity(self) -> str:
        """How close its answers are, in words (logs, the profile's reason)."""
        parts = [f"top-1 agreement {self.top1_agreement:.1%} on {self.samples} real samples"
                 ] if self.top1_agreement is not None else []
        parts += [] if self.output_error is None else [f"outputs {self.output_error:.1%} apart"]
        return ", ".join(parts) or "not compared"

    def to_dict(self) -> dict[str, Any]:
        return {**self.variant.to_dict(), "rows": [r.to_dict() for r in self.rows],
                "stopped": self.stopped,
                "output_error": None if self.output_error is None
                else round(self.output_error, 5),
                "top1_agreement": None if self.top1_agreement is None
                else round(self.top1_agreement, 5),
                "samples": self.samples, "faithful": self.faithful}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measured:
        error, agreement = d.get("output_error"), d.get("top1_agreement")
        return cls(Variant.from_dict(d), tuple(Row.from_dict(r) for r in d["rows"]),
                   str(d.get("stopped", "")), None if error is None else float(error),
                   None if agreement is None else float(agreement), int(d.get("samples", 0)))


@dataclass(frozen=True, slots=True)
class Choice:
    """What the worker applies: the variant, the max batch, the sizes batches round up to,
    and the latency per batch size (ms, the chosen variant's medians) that seeds the
    batcher's estimator."""

    variant: Variant
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    latency_ms: Mapping[int, float] = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant.to_dict(), "max_batch_size": self.max_batch_size,
                "preferred_batch_sizes": list(self.preferred_batch_sizes),
                "latency_ms": {str(k): round(v, 3) for k, v in sorted(self.latency_ms.items())},
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Choice:
        return cls(Variant.from_dict(d["variant"]), int(d["max_batch_size"]),
                   tuple(int(s) for s in d.get("preferred_batch_sizes", ())),
                   {int(k): float(v) for k, v in d.get("latency_ms", {}).items()},
                   str(d.get("reason", "")))


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    #: "cpu" or "cuda".
    kind: str
    #: GPU name, or the CPU's model name.
    name: str
    #: Torch intra-op threads the measurements ran with (they matter on CPU).
    torch_threads: int
    total_memory_bytes: int | None = None
    #: CPU: batches run at once, each on torch_threads threads.
    lanes: int = 1

    @property
    def slug(self) -> str:
        """File-name part: kind, name, and on CPU lanes x threads ('cpu-amd-epyc-2x1t')."""
        base = f"{self.kind}-{self.name}" + (f"-{self.lanes}x{self.torch_threads}t"
                                             if self.kind == "cpu" else "")
        return re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")


@dataclass(frozen=True, slots=True)
class Profile:
    """Everything in one profile file (see README "Calibration and tuning")."""

    model: str
    model_spec: str
    fingerprint: str
    device: DeviceInfo
    torch_version: str
    created_utc: str
    #: How it was measured: latency_budget_ms, max_batch_cap, runs, quick.
    settings: Mapping[str, Any]
    measured: tuple[Measured, ...]
    choice: Choice

    def to_dict(self) -> dict[str, Any]:
        d = self.device
        return {"schema": SCHEMA, "model": self.model, "model_spec": self.model_spec,
                "fingerprint": self.fingerprint,
                "device": {"kind": d.kind, "name": d.name, "torch_threads": d.torch_threads,
                           "lanes": d.lanes, "total_memory_bytes": d.total_memory_bytes},
                "torch_version": self.torch_version, "created_utc": self.created_utc,
                "settings": dict(self.settings),
                "variants": [m.to_dict() for m in self.measured],
                "choice": self.choice.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        """Raises ValueError for another schema version or a malformed file."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"profile schema {d.get('schema')!r}, expected {SCHEMA}")
        try:
            dev = d["device"]
            return cls(str(d["model"]), str(d["model_spec"]), str(d["fingerprint"]),
                       DeviceInfo(str(dev["kind"]), str(dev["name"]), int(dev["torch_threads"]),
                                  dev.get("total_memory_bytes"), int(dev.get("lanes", 1))),
                       str(d["torch_version"]), str(d["created_utc"]), dict(d["settings"]),
                       tuple(Measured.from_dict(m) for m in d["variants"]),
                       Choice.from_dict(d["choice"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed profile: {type(e).__name__}: {e}") from e


def default_profile_dir() -> Path:
    """$REDBATCH_PROFILE_DIR, else $XDG_CACHE_HOME/redbatch/profiles (~/.cache/...)."""
    if os.environ.get(PROFILE_DIR_ENV):
        return Path(os.environ[PROFILE_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "redbatch" / "profiles"


def profile_path(directory: Path, model: str, device: DeviceInfo) -> Path:
    """``<dir>/<model>--<device slug>.json``."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]+", "_", model)
    return directory / f"{safe}--{device.slug}.json"


def save_profile(profile: Profile, path: Path) -> None:
    """Write atomically (temporary file, then rename), so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_profile(path: Path) -> Profile:
    """Raises OSError when unreadable and ValueError when not a valid profile."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    return Profile.from_dict(data)


# ---------------------------------------------------------------------------- choosing


def within_budget(rows: Sequence[Row], latency_budget_ms: float | None) -> list[Row]:
    """Rows whose p95 batch latency fits the budget (all rows without a budget)."""
    if latency_budget_ms is None:
        return list(rows)
    return [r for r in rows if r.p95_ms <= latency_budget_ms]


def pick_max_batch(rows: Sequence[Row], latency_budget_ms: float | None = None,
                   share: float = PEAK_SHARE) -> int:
    """The smallest batch size reaching ``share`` of the peak throughput among the sizes
    whose p95 latency stays within ``latency_budget_ms``.

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


def pick_variant(measured: Sequence[Measured], latency_budget_ms: float | None = None,
                 share: float = PEAK_SHARE, allow_reduced_precision: bool = False
                 ) -> tuple[Measured, int]:
    """The variant with the highest throughput at its own chosen max batch, and that size,
    among the eligible ones (:meth:`Measured.eligible`).

    The first variant (the plain one) wins ties: another must be MEASURABLY_FASTER.
    """
    if not measured:
        raise ValueError("no variants measured")
    best: tuple[Measured, int, float] | None = None
    for m in measured:
        if not m.rows or not m.eligible(allow_reduced_precision):
            continue
        size = pick_max_batch(m.rows, latency_budget_ms, share)
        rate = next(r.images_per_s for r in m.rows if r.batch_size == size)
        if best is None or rate > best[2] * MEASURABLY_FASTER:
            best = (m, size, rate)
    if best is None:
        raise ValueError("no variant has measurements")
    return best[0], best[1]


def preferred_sizes(rows: Sequence[Row], max_batch_size: int) -> tuple[int, ...]:
    """Sizes that batches may be rounded up to: a size measured faster (by
    MEASURABLY_FASTER) than a smaller size measured, so padding a batch up to it saves
    time (e.g. 8 faster than 7 on a GPU whose kernels like multiples of 8)."""
    by_size = {r.batch_size: r.median_ms for r in rows if r.batch_size <= max_batch_size}
    return tuple(s for s in sorted(by_size)
                 if any(t < s and by_size[t] > by_size[s] * MEASURABLY_FASTER for t in by_size))


def choose(measured: Sequence[Measured], latency_budget_ms: float | None = None,
           share: float = PEAK_SHARE, extra_rows: Sequence[Row] = (),
           allow_reduced_precision: bool = False) -> Choice:
    """The whole choice from the tables; ``extra_rows`` are in-between sizes (e.g. 7, 15)
    measured for the chosen variant after the sweep, used for preferred sizes. The reason
    says why, the fidelity of the chosen variant and the faster ones left out included."""
    best, size = pick_variant(measured, latency_budget_ms, share, allow_reduced_precision)
    rows = sorted([*best.rows, *extra_rows], key=lambda r: r.batch_size)
    peak = max(within_budget(best.rows, latency_budget_ms) or best.rows,
               key=lambda r: r.images_per_s)
    budget = "" if latency_budget_ms is None else f", p95 within {latency_budget_ms:g} ms"
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


def eligible_choice(profile: Profile, allow_reduced_precision: bool = False
                    ) -> tuple[Choice, str]:
    """The profile's choice if its variant may still be chosen under today's rules, else
    the choice made again from its tables, and a note saying why. A profile written
    before answers were compared on real samples may have chosen reduced precision on
    random inputs alone: a worker never serves that silently."""
    chosen = next((m for m in profile.measured if m.variant == profile.choice.variant), None)
    if chosen is None or chosen.eligible(allow_reduced_precision):
        return profile.choice, ""
    budget = profile.settings.get("latency_budget_ms")
    try:
        choice = choose(profile.measured, None if budget is None else float(budget),
                        allow_reduced_precision=allow_reduced_precision)
    except ValueError:  # only that variant was measured: the same, in full precision
        full = dataclasses.replace(chosen.variant, autocast=None)
        choice = dataclasses.replace(profile.choice, variant=full, latency_ms={},
                                     reason=f"{profile.choice.reason}; full precision")
    return choice, (f"the profile chose {chosen.variant.name} ({chosen.fidelity()}), which "
                    f"may change answers: using {choice.variant.name}, max batch "
                    f"{choice.max_batch_size} from its tables; `redbatch calibrate` checks "
                    "every variant on real samples, and --allow-reduced-precision accepts it")
