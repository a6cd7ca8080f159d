"""Calibration: measure the model alone on the device, per variant and batch size, and choose.

The variants worth trying on the device (channels_last, and on CUDA autocast
fp16/bf16; torch.compile when asked) are timed for batch sizes 1, 2, 4, ... up
to a cap (sweep.py), their answers compared with the plain model's on real
samples (fidelity.py), and the choice made from the tables (choosing.py); the
profile holds all of it (profile.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from redbatch.common.config import (
    DEFAULT_MAX_WAIT_MS,
    Budget,
    LimitSettings,
    TuneSettings,
    default_of,
    model_name_from_spec,
)
from redbatch.gpu_worker.device.prepare import resolve_device
from redbatch.gpu_worker.tuning.choosing import choose
from redbatch.gpu_worker.tuning.fidelity import check_fidelity
from redbatch.gpu_worker.tuning.profile import (
    MIN_TOP1_AGREEMENT,
    Profile,
    Row,
    default_profile_dir,
    profile_path,
    save_profile,
)
from redbatch.gpu_worker.tuning.sweep import between_sizes, sweep
from redbatch.gpu_worker.tuning.variants import (
    Model,
    candidate_variants,
    device_info,
    fingerprint,
    parse_variant,
)
from redbatch.handlers.base import Handler, calibrates, load_handler

logger = logging.getLogger(__name__)

#: Largest batch tried when no cap is given: CPU throughput peaks far below this, and on
#: CUDA the memory watermark or the plateau usually stops the sweep first.
DEFAULT_CAP = {"cpu": 64, "cuda": 512}
#: CPU: measurements that got less than this share of their threads' time (others were
#: running) are marked contended; a worker measures a contended quick profile again.
CONTENDED_SHARE = 0.75
#: Batch size at which every variant's outputs are compared with the plain one's.
ERROR_CHECK_BATCH = 8
#: Real samples (the handler's ``calibration_samples``) every variant's answers are
#: compared on: at 99.5% agreement, 256 allow one changed answer; a worker's own quick
#: calibration checks fewer, and so allows none.
FIDELITY_SAMPLES = 256
QUICK_FIDELITY_SAMPLES = 64


@dataclass(frozen=True, slots=True)
class CalibrationSettings:
    #: Largest batch size tried; None: DEFAULT_CAP for the device kind.
    max_batch: int | None = None
    #: p95 latency a batch may take: ms, "auto" (the default budget, latency.py) or None.
    latency_budget_ms: Budget = "auto"
    #: The batcher's max wait, ms, which the default budget's simulation assumes.
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    #: Timed runs per batch size and variant (median and p95 are over these).
    runs: int = 7
    #: Untimed runs per size first (lazy init, cuDNN benchmarking, compilation).
    warmup_runs: int = 2
    #: Rounds over all the kept sizes after the first pass (sweep.in_rounds); 1: none.
    rounds: int = 3
    #: Add torch.compile variants (CPU: 5-35 s of compilation per batch size with a cold
    #: cache, a few seconds with a warm one). None: on CPU when a C++ compiler is
    #: installed (inductor needs one), never on CUDA (there it needs Triton, and pays off
    #: less: ask for it).
    try_compile: bool | None = None
    #: Only these variants, by name (e.g. "eager", "channels_last+fp16"); empty: all.
    variants: tuple[str, ...] = ()
    #: CUDA: share of device memory the sweep leaves free.
    memory_watermark: float = default_of(TuneSettings, "memory_watermark")
    #: Marks a worker's own quick calibration in the profile.
    quick: bool = False
    #: CPU: batches run at once, as the worker runs them (device/prepare.py cpu_lanes).
    lanes: int = 1
    #: Real samples the variants' answers are compared on (0: none, random inputs only).
    fidelity_samples: int = FIDELITY_SAMPLES
    #: Reduced precision may be chosen without matching the plain model's top class on
    #: the samples (the operator accepts changed answers for speed).
    allow_reduced_precision: bool = False

    @classmethod
    def quick_settings(cls, max_batch: int | None) -> CalibrationSettings:
        """The worker's calibration when no profile exists: few runs, same rules."""
        return cls(max_batch=max_batch, runs=3, warmup_runs=1, rounds=1, quick=True,
                   fidelity_samples=QUICK_FIDELITY_SAMPLES)


def calibrate(handler: Handler, model: Model, device: torch.device, spec: str, name: str,
              settings: CalibrationSettings,
              report: Callable[[str], None] = logger.info) -> Profile:
    """Warm up, measure, choose; returns the profile (the caller saves it).

    ``model`` is the loaded model, as ``handler.load(device)`` returned it; it is
    changed in place (memory format) and may be copied once.
    """
    fp = fingerprint(handler, model)
    cap = settings.max_batch or DEFAULT_CAP.get(device.type, 64)
    names = settings.variants
    variants = [parse_variant(n) for n in names] if names else \
        candidate_variants(device, settings.try_compile)
    # The lanes are part of a CPU profile's file name: without them `redbatch calibrate`
    # would store a profile that a worker running 2 lanes never looks for.
    info = device_info(device, settings.lanes)
    report(f"calibrating {name} on {info.kind} ({info.name}, {info.lanes} batches at once x "
           f"{info.torch_threads} torch threads): variants "
           f"{', '.join(v.name for v in variants)}; batch sizes up to {cap}")
    measured, runs = sweep(handler, model, device, variants, cap, settings, report)
    check = min([cap, ERROR_CHECK_BATCH, *(m.rows[-1].batch_size for m in measured if m.rows)])
    measured = check_fidelity(handler, runs, measured, check, settings.fidelity_samples,
                              settings.allow_reduced_precision, report)
    allow, budget, wait = (settings.allow_reduced_precision, settings.latency_budget_ms,
                           settings.max_wait_ms)
    choice = choose(measured, budget, allow_reduced_precision=allow, max_wait_ms=wait,
                    device_kind=device.type)
    # Sizes just below the powers of two, for the chosen variant only: may round up pay?
    extra = [s for s in between_sizes(choice.max_batch_size)
             if s not in {r.batch_size for m in measured for r in m.rows}]
    extra_rows = [got for s in extra
                  for got in runs.time_size(s, [choice.variant]).values()
                  if isinstance(got, Row)]
    choice = choose(measured, budget, extra_rows={choice.variant: extra_rows},
                    allow_reduced_precision=allow, max_wait_ms=wait, device_kind=device.type)
    return Profile(model=name, model_spec=spec, fingerprint=fp, device=info,
                   torch_version=torch.__version__,
                   created_utc=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   settings={"latency_budget_ms": budget, "max_wait_ms": wait,
                             "max_batch_cap": cap,
                             "runs": settings.runs, "quick": settings.quick,
                             "allow_reduced_precision": allow,
                             "min_top1_agreement": MIN_TOP1_AGREEMENT,
                             "cpu_share": None if runs.cpu_share is None
                             else round(runs.cpu_share, 3)},
                   measured=tuple(measured), choice=choice)


def calibrate_to_file(spec: str, device_spec: str, torch_threads: int,
                      settings: CalibrationSettings, out: Path | None, profile_dir: str,
                      report: Callable[[str], None]) -> tuple[Profile, Path]:
    """``redbatch calibrate``: load the model, measure with ``torch_threads`` threads, and
    write the profile to ``out`` or to its place in the profile directory. Raises
    ValueError for an unknown model, device or variant."""
    torch.set_num_threads(torch_threads)
    device = resolve_device(device_spec)
    handler = load_handler(spec, LimitSettings())
    if not calibrates(handler):
        raise ValueError(f"calibration cannot measure {spec!r}: its inputs vary in shape "
                         "(workers serve it without a profile)")
    for name in settings.variants:
        parse_variant(name)  # refuse a typo before loading anything
    model = handler.load(device)
    name = model_name_from_spec(spec)
    profile = calibrate(handler, model, device, spec, name, settings, report)
    path = out or profile_path(Path(profile_dir) if profile_dir else default_profile_dir(), name,
                               profile.device)
    save_profile(profile, path)
    return profile, path
