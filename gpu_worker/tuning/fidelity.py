"""Does a faster variant keep the model's answers? Calibration's check, on real inputs.

Reduced precision (bf16, fp16 autocast) and compiled graphs round differently from the
plain float32 model. Compared on random tensors, bf16 autocast on this repository's CPU
was 2.3% away, well within the distance that flags a broken variant, and yet it changed
the top class of 3.8% of the photos it served. So every variant runs on the handler's
real samples (``calibration_samples``: for the image models, the sample photos and crops
of them, handlers/samples.py), and its top class is compared with the plain model's on
each. The rules that judge the result (MIN_TOP1_AGREEMENT, ``--allow-reduced-precision``)
are in profile.py, pure; this module runs the comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from redbatch.gpu_worker.tuning.profile import Measured, Variant
from redbatch.handlers.base import Handler


class Runs(Protocol):
    """What the comparison needs from calibration's sweep: every variant's output rows
    for inputs run in batches of one size (calibrate.py ``_Sweep.outputs``)."""

    def outputs(self, variants: Sequence[Variant], size: int,
                inputs: np.ndarray | None = None) -> dict[Variant, torch.Tensor]: ...


def compare(outputs: dict[Variant, torch.Tensor], reference: Variant,
            real: bool) -> dict[Variant, tuple[float, float | None]]:
    """Each variant's (largest relative L2 distance of a row, top-1 agreement) against
    ``reference``'s outputs; the agreement (argmax of each row) only on ``real`` inputs,
    where a top class means something."""
    base = outputs.get(reference)
    if base is None:
        return {}
    scale = base.norm(dim=1).clamp_min(1e-12)
    top = base.argmax(dim=1)
    return {v: (float(((out - base).norm(dim=1) / scale).max()),
                float((out.argmax(dim=1) == top).float().mean()) if real else None)
            for v, out in outputs.items() if out.shape == base.shape}


def real_samples(handler: Handler, count: int,
                 report: Callable[[str], None]) -> np.ndarray | None:
    """``count`` of the handler's calibration samples, preprocessed as the pool does, or
    None when it has none (or none could be read)."""
    make = getattr(handler, "calibration_samples", None)
    if make is None or count <= 0:
        return None
    samples = make(count)
    out = np.empty((len(samples), *handler.input_shape), dtype=handler.input_dtype)
    kept = 0
    for payload, content_type in samples:
        try:
            handler.preprocess(payload, content_type, {}, out[kept])
            kept += 1
        except Exception as e:  # noqa: BLE001 - a bad sample is left out, and said
            report(f"  calibration sample left out: {type(e).__name__}: {e}")
    return out[:kept] if kept else None


def check_fidelity(handler: Handler, runs: Runs, measured: list[Measured], check: int,
                   count: int, allow_reduced_precision: bool,
                   report: Callable[[str], None]) -> list[Measured]:
    """``measured`` with each variant's fidelity against the first (plain) one: on
    ``count`` of the handler's real samples when it has some (top-1 agreement and
    distance), else on the random rows already in the slots (distance only). Run in
    batches of ``check``, a size every variant ran: a compiled one would otherwise compile
    one more shape."""
    samples = real_samples(handler, count, report)
    variants = [m.variant for m in measured]
    compared = compare(runs.outputs(variants, check, samples), variants[0], samples is not None)
    n = 0 if samples is None else len(samples)
    measured = [dataclasses.replace(m, output_error=error, top1_agreement=agreement,
                                    samples=n if m.variant in compared else 0)
                for m in measured
                for error, agreement in [compared.get(m.variant, (None, None))]]
    for m in measured[1:]:
        verdict = "kept" if m.faithful else (
            "allowed (--allow-reduced-precision)" if m.eligible(allow_reduced_precision)
            else "changes answers: not chosen")
        report(f"  {m.variant.name}: {m.fidelity()} against {variants[0].name}: {verdict}")
    return measured
