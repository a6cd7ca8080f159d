"""What a worker applies at start: its calibration profile, and the CPU path's threads.

Precedence, for each tunable setting (max batch size, channels_last,
autocast, compile): a flag or REDBATCH_* variable given explicitly wins, then
the profile, then the built-in default. ``--calibrate`` decides where the
profile comes from: ``auto`` loads it and, when there is none for this model
and device (or it was measured on another model: the fingerprint differs),
runs a quick calibration and stores it; ``load`` only loads; ``off`` uses no
profile at all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from redbatch.common.config import Settings, model_name_from_spec
from redbatch.gpu_worker.tuning.choosing import served_choice
from redbatch.gpu_worker.tuning.profile import (
    Profile,
    Variant,
    default_profile_dir,
    load_profile,
    profile_path,
    save_profile,
)
from redbatch.handlers.base import Handler, calibrates

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class Tuned:
    """The settings to run with, and what the device path needs from the profile."""

    settings: Settings
    device: torch.device | None = None
    #: The loaded model (calibration may have changed its memory format).
    model: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: CPU: batches run at once (gpu_worker/device/runner.py cpu_lanes).
    lanes: int = 1
    profile: Profile | None = None
    #: Sizes batches are padded up to (see Batcher.run_size).
    preferred_sizes: tuple[int, ...] = ()
    #: Pad every batch to a preferred size (compiled models: one graph per size).
    always_round_up: bool = False
    #: Measured seconds per batch size, to seed the batcher's estimator.
    latency_s: dict[int, float] = field(default_factory=dict)
    #: Lines for the start-up log.
    notes: list[str] = field(default_factory=list)
    #: The compiled package the model is served from (gpu_worker/device/packaged.py), or None.
    package: Path | None = None

    @property
    def variant(self) -> Variant:
        m = self.settings.model
        return Variant(m.channels_last, m.autocast or None, m.compile)


def apply_profile(settings: Settings, profile: Profile) -> Tuned:
    """The profile's choice for every tunable setting not given explicitly. Pure."""
    explicit = settings.tune.explicit
    tune = settings.tune
    choice, why = served_choice(profile, tune.allow_reduced_precision, tune.latency_budget_ms,
                                "latency_budget_ms" in explicit, settings.batch.max_wait_ms)
    batch, model = settings.batch, settings.model
    took: list[str] = []
    kept: list[str] = []

    def pick(name: str, mine: T, theirs: T) -> T:
        if name in explicit:
            if mine != theirs:
                kept.append(f"{name}={_shown(mine)} (given; profile: {_shown(theirs)})")
            return mine
        took.append(f"{name}={_shown(theirs)}")
        return theirs

    max_batch = pick("max_batch_size", batch.max_batch_size, choice.max_batch_size)
    inflight = batch.max_inflight
    if "max_inflight" in explicit:
        max_batch = min(max_batch, inflight)
    else:  # room for a batch running, the next one forming, and decoding ahead
        inflight = max(inflight, 2 * max_batch)
    v = choice.variant
    new_model = dataclasses.replace(
        model, channels_last=pick("channels_last", model.channels_last, v.channels_last),
        autocast=pick("autocast", model.autocast, v.autocast or ""),
        compile=pick("compile", model.compile, v.compile))
    new_batch = dataclasses.replace(batch, max_batch_size=max_batch, max_inflight=inflight,
                                    interactive_reserve=0)
    applied = dataclasses.replace(settings, batch=new_batch, model=new_model)
    same_variant = Variant(new_model.channels_last, new_model.autocast or None,
                           new_model.compile) == v
    notes = [why] if why else []
    notes.append(f"from the profile: {', '.join(took) or 'nothing (all given explicitly)'}")
    if kept:
        notes.append(f"given explicitly, kept over the profile: {', '.join(kept)}")
    # The measured times hold for the variant measured; another variant learns its own.
    latency = {s: ms / 1000 for s, ms in choice.latency_ms.items()} if same_variant else {}
    preferred = tuple(s for s in choice.preferred_batch_sizes if s <= max_batch) \
        if same_variant else ()
    return Tuned(applied, None, None, 1, profile, preferred, same_variant and v.compile,
                 latency, notes)


def _shown(value: object) -> str:
    return "off" if value in ("", None, False) else "on" if value is True else str(value)


def profile_dir(settings: Settings) -> Path:
    return Path(settings.tune.profile_dir) if settings.tune.profile_dir else default_profile_dir()


def find_profile(path: Path, fingerprint: str) -> tuple[Profile | None, str]:
    """The profile at ``path`` if it is usable for the model with ``fingerprint``, and a
    note saying why not otherwise."""
    if not path.exists():
        return None, f"no profile at {path}"
    try:
        profile = load_profile(path)
    except (OSError, ValueError) as e:
        return None, f"profile {path} unusable ({e})"
    if profile.fingerprint != fingerprint:
        return None, (f"profile {path} was measured on another model (fingerprint "
                      f"{profile.fingerprint} != {fingerprint})")
    return profile, ""


def worth_measuring_again(profile: Profile, settings: Settings) -> str:
    """Why a worker's own (quick) profile should be measured again at this start, or ''.

    A quick calibration that ran on a busy machine (CONTENDED_SHARE), or that was capped
    by an explicit --max-batch-size and chose its cap while this worker has no such cap,
    says little. Profiles from ``redbatch calibrate`` are never second-guessed.
    """
    from redbatch.gpu_worker.tuning.calibrate import CONTENDED_SHARE

    measured = profile.settings
    if not measured.get("quick"):
        return ""
    share = measured.get("cpu_share")
    if share is not None and share < CONTENDED_SHARE:
        return f"was measured on a busy machine ({share:.0%} of its CPU time)"
    cap = measured.get("max_batch_cap")
    if "max_batch_size" not in settings.tune.explicit and cap is not None and \
            profile.choice.max_batch_size >= cap:
        return f"was measured only up to batch {cap}"
    return ""


def tune(settings: Settings, handler: Handler) -> Tuned:
    """Resolve the device, set torch's threads, size the pool (``sized_pool``), load the
    model, then load (or, with ``--calibrate auto``, measure and store) the profile and
    apply it.

    Raises ValueError for a device that does not exist.
    """
    import torch
    from redbatch.gpu_worker.device.prepare import choose_torch_threads, cpu_lanes, resolve_device
    from redbatch.gpu_worker.tuning.variants import device_info, fingerprint

    device = resolve_device(settings.model.device)
    lanes = cpu_lanes(settings.model.cpu_lanes) if device.type == "cpu" else 1
    threads = choose_torch_threads(settings.model.torch_threads, settings.pool.processes,
                                   device.type, lanes)
    torch.set_num_threads(threads)
    settings, pool_note = sized_pool(settings, device.type, lanes, threads)
    model = handler.load(device)
    # This model's profile file on this device, and the model's fingerprint: the profile
    # is looked up by both, and a compiled package is named after them.
    path = profile_path(profile_dir(settings), model_name_from_spec(settings.model.spec),
                        device_info(device, lanes))
    fp = fingerprint(handler, model)
    tuned = _with_profile(settings, handler, model, device, lanes, path, fp)
    tuned.device, tuned.model, tuned.lanes = device, model, lanes
    tuned.notes.insert(0, pool_note)
    _use_package(tuned, device, path, fp)
    return tuned


def _use_package(tuned: Tuned, device: torch.device, profile_file: Path, fp: str) -> None:
    """A compiled variant in full precision is served from an AOTInductor package kept
    beside the profile (NOTE [ Compiled packages ] in gpu_worker/device/packaged.py): one graph
    for every batch size, so batches are not padded to compiled sizes."""
    from redbatch.gpu_worker.device.packaged import package_path, packaged

    if not packaged(tuned.variant, device):
        return
    tuned.package = package_path(profile_file, fp, tuned.variant,
                                 tuned.settings.batch.max_batch_size, device)
    tuned.preferred_sizes, tuned.always_round_up = (), False


def sized_pool(settings: Settings, device_type: str, lanes: int,
               torch_threads: int) -> tuple[Settings, str]:
    """``settings`` with the pool's processes resolved (0: auto, gpu_worker/device/prepare.py
    ``choose_pool_processes``), and a line for the start-up log saying how. Pure."""
    from redbatch.gpu_worker.device.prepare import choose_pool_processes, pool_rule

    asked = settings.pool.processes
    n = choose_pool_processes(asked, device_type, lanes, torch_threads)
    how = "given" if asked else (f"auto on {device_type} with {os.cpu_count() or 1} cores: "
                                 f"{pool_rule(device_type)}")
    pool = dataclasses.replace(settings.pool, processes=n)
    return dataclasses.replace(settings, pool=pool), f"pool: {n} preprocessing processes ({how})"


def _with_profile(settings: Settings, handler: Handler,
                  model: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                  lanes: int, path: Path, fp: str) -> Tuned:
    """The profile at ``path`` applied (for the model with fingerprint ``fp``), as
    ``--calibrate`` says: loaded, measured quickly and stored first, or none."""
    from redbatch.gpu_worker.device.watchdog import Watchdog
    from redbatch.gpu_worker.tuning.calibrate import (
        CONTENDED_SHARE,
        CalibrationSettings,
        calibrate,
    )

    mode = settings.tune.calibrate
    if mode == "off":
        return Tuned(settings, notes=["calibration off: no profile, flags and defaults only"])
    if not calibrates(handler):
        return Tuned(settings, notes=["calibration: not for this model (its inputs vary in "
                                      "shape), flags and defaults only"])
    name = model_name_from_spec(settings.model.spec)
    profile, why = find_profile(path, fp)
    if profile is not None and mode == "auto" and (why := worth_measuring_again(profile,
                                                                               settings)):
        profile, why = None, f"profile {path} {why}"
    notes = []
    if profile is None and mode == "auto":
        cap = settings.batch.max_batch_size if "max_batch_size" in settings.tune.explicit \
            else None
        allow_lossy = settings.tune.allow_reduced_precision
        logger.info("%s: calibrating (quick) before serving", why)
        # --compile/--no-compile given: measure only what was asked for.
        compile_asked = settings.model.compile if "compile" in settings.tune.explicit else None
        how = dataclasses.replace(CalibrationSettings.quick_settings(cap),
                                  latency_budget_ms=settings.tune.latency_budget_ms,
                                  max_wait_ms=settings.batch.max_wait_ms, lanes=lanes,
                                  try_compile=compile_asked,
                                  allow_reduced_precision=allow_lossy)
        with Watchdog(settings.warmup_timeout_s) as dog:  # a hang exits 3
            profile = calibrate(handler, model, device, settings.model.spec, name, how,
                                watch=dog.watch)
        save_profile(profile, path)
        notes.append(f"calibrated and stored profile {path}")
        share = profile.settings.get("cpu_share")
        if share is not None and share < CONTENDED_SHARE:
            logger.warning("the calibration got %.0f%% of its threads' CPU time (other "
                           "processes were busy): its figures are pessimistic; the next start "
                           "measures again, or run `redbatch calibrate` on a quiet machine",
                           100 * share)
    elif profile is None:
        return Tuned(settings, notes=[f"{why}; flags and defaults only"])
    else:
        quick = ", quick" if profile.settings.get("quick") else ""
        notes.append(f"loaded profile {path} (measured {profile.created_utc}, torch "
                     f"{profile.torch_version}{quick})")
    tuned = apply_profile(settings, profile)
    tuned.notes[:0] = notes
    return tuned


def warmup_sizes(max_batch_size: int, preferred: tuple[int, ...], cuda: bool) -> list[int]:
    """Batch sizes to run before serving. On CUDA every size a batch may have (cuDNN
    benchmarks each new shape once, slowly), up to 64; past that, powers of two. On CPU,
    1 and the max. Always the preferred sizes."""
    sizes = {1, max_batch_size, *preferred}
    if cuda:
        sizes |= set(range(1, max_batch_size + 1)) if max_batch_size <= 64 else \
            {1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size}
    return sorted(s for s in sizes if s <= max_batch_size)
