"""Calibration profiles: what was measured for one model on one device, and what was chosen.

A profile is a JSON file per (model, device), written by ``redbatch calibrate``
(or by a worker's own quick calibration) and read by ``redbatch worker`` at
start. It holds, per device-path variant (channels_last, autocast, compile),
the latency and throughput of each batch size measured, and the choice made
from them: the variant, the max batch size and the preferred batch sizes
(the rules that choose are in choosing.py).

Pure: no torch, no I/O beyond reading and writing the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redbatch.common.config import parse_latency_budget

#: Version of the file layout; a file of another version is ignored (and re-measured).
SCHEMA = 1
#: Where profiles live when REDBATCH_PROFILE_DIR is not set: $XDG_CACHE_HOME/redbatch/profiles.
PROFILE_DIR_ENV = "REDBATCH_PROFILE_DIR"
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
    """One way of running the model on the device (see gpu_worker/device/runner.py DevicePath)."""

    channels_last: bool = False
    #: "float16", "bfloat16" or None (full precision).
    autocast: str | None = None
    #: torch.compile (inductor, static shapes).
    compile: bool = False

    def pads_batches(self, device_kind: str) -> bool:
        """Whether every batch is padded to a size measured: compiled with torch.compile,
        one graph per size. On CPU a full-precision compiled variant is served from an
        AOTInductor package with a dynamic batch instead (gpu_worker/device/packaged.py)."""
        return self.compile and not (device_kind == "cpu" and self.autocast is None)

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
        """Raises ValueError for a size under 1 or a time that is not a positive number
        (the latency simulation divides by them)."""
        peak = d.get("peak_memory_bytes")
        row = cls(int(d["batch_size"]), float(d["median_ms"]), float(d["p95_ms"]),
                  int(d["runs"]), None if peak is None else int(peak),
                  int(d.get("batches_at_once", 1)))
        if row.batch_size < 1 or row.batches_at_once < 1 or \
                not 0 < row.median_ms < math.inf or not 0 <= row.p95_ms < math.inf:
            raise ValueError(f"malformed profile row {dict(d)}")
        return row


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
        """Raises ValueError unless the rows' sizes ascend."""
        error, agreement = d.get("output_error"), d.get("top1_agreement")
        rows = tuple(Row.from_dict(r) for r in d["rows"])
        sizes = [r.batch_size for r in rows]
        if sizes != sorted(set(sizes)):
            raise ValueError("malformed profile: batch sizes not ascending")
        return cls(Variant.from_dict(d), rows,
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
    """Everything in one profile file (see docs/tuning.md "Calibration")."""

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
            # The budget it was chosen with: a worker may choose again under it.
            parse_latency_budget(str(d["settings"].get("latency_budget_ms")))
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
