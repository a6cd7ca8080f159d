"""``redbatch calibrate``: measure the model alone on the device and store its profile.

The measuring is ``gpu_worker/tuning/calibrate.py``'s; this module only parses the
options, picks the threads and lanes the worker would run with, and prints the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from redbatch.cli import options as o
from redbatch.common.logs import setup_logging

if TYPE_CHECKING:
    from redbatch.gpu_worker.tuning.calibrate import CalibrationSettings
    from redbatch.gpu_worker.tuning.profile import Profile


@click.command()
@o.MODEL()
@o.DEVICE()
# The sweep's own budget, given per run: no variable.
@o.LATENCY_BUDGET_MS(envvar=None)
@click.option("--max-batch-size", "--max-batch", "max_batch", type=click.IntRange(min=1),
              default=None,
              help="Largest batch size tried [default: 64 on CPU, 512 on CUDA; the sweep "
                   "also stops at the free-memory watermark or when throughput falls].")
@click.option("--runs", type=click.IntRange(min=1), default=7, show_default=True,
              help="Timed runs per batch size and variant in the first pass (at most 3 "
                   "when rounds follow).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds over all the kept sizes after the first pass, 2 timed runs of each "
                   "size a round (the tables' medians come from them); 1: none.")
@click.option("--warmup-runs", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed runs per batch size and variant first.")
@click.option("--fidelity-samples", type=click.IntRange(min=0), default=None,
              help="Real samples each variant's answers are compared on; 0: random inputs "
                   "only [default: the calibration's own].")
@click.option("--variant", "variants", multiple=True,
              help="Measure only this variant (repeatable): eager, channels_last, fp16, bf16, "
                   "compile, or a '+' combination such as channels_last+fp16.")
# Not the worker's --compile (serve compiled): whether to measure compiled variants too.
@click.option("--compile/--no-compile", "try_compile", default=None,
              help="Also try torch.compile [default: on CPU when a C++ compiler is installed; "
                   "5-35 s of compilation per batch size the first time, seconds after].")
@o.POOL_PROCESSES(help="The worker's preprocessing processes (they decide its torch threads).")
@o.TORCH_THREADS(help="Torch threads to measure with; 0: what the worker would use.")
@o.CPU_LANES(help="CPU: batches run at once, as the worker runs them; 0: what the worker "
                  "would use.")
@o.MEMORY_WATERMARK(help="CUDA: share of device memory the sweep leaves free.")
@o.ALLOW_REDUCED_PRECISION()
@o.PROFILE_DIR(help="Where profiles are stored (default: ~/.cache/redbatch/profiles).")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Profile file to write [default: <profile dir>/<model>--<device>.json].")
@o.LOG_LEVEL(default="WARNING")
def calibrate(**options: Any) -> None:
    """Measure the model alone on the device and store its profile for `redbatch worker`.

    Times batch sizes 1, 2, 4, ... for each device-path variant, checks each variant's
    answers against the plain model's on real samples (the sample photos and crops of
    them: 99.5% must keep their top class), picks the smallest batch size reaching 95% of
    the peak throughput within the latency budget and the fastest faithful variant, and
    prints the table and the choice.
    """
    from redbatch.gpu_worker.device.malloc_tuning import reexec_with_malloc_tuning

    reexec_with_malloc_tuning("redbatch.cli")  # measure under the worker's malloc
    setup_logging(options.pop("log_level"))
    # Imported here: torch loads with these, which the other commands never need.
    from redbatch.gpu_worker.device.prepare import choose_torch_threads, cpu_lanes, resolve_device
    from redbatch.gpu_worker.tuning.calibrate import calibrate_to_file

    try:
        kind = resolve_device(options["device"]).type
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    lanes = cpu_lanes(options["cpu_lanes"]) if kind == "cpu" else 1
    threads = choose_torch_threads(options["torch_threads"], options["pool_processes"], kind,
                                   lanes)
    out = Path(options["out"]) if options["out"] else None
    try:
        profile, path = calibrate_to_file(
            options["model_spec"], options["device"], threads, _settings(options, lanes), out,
            options["profile_dir"], click.echo)
    except ValueError as e:  # a bad --model, --device or --variant
        raise click.ClickException(str(e)) from e
    click.echo(format_table(profile))
    click.echo(f"profile written to {path}")


def _settings(options: dict[str, Any], lanes: int) -> CalibrationSettings:
    """The sweep's CalibrationSettings, from the parsed options."""
    from redbatch.gpu_worker.tuning.calibrate import CalibrationSettings

    samples = {} if options["fidelity_samples"] is None else \
        {"fidelity_samples": options["fidelity_samples"]}
    return CalibrationSettings(
        max_batch=options["max_batch"], latency_budget_ms=options["latency_budget_ms"],
        runs=options["runs"], warmup_runs=options["warmup_runs"], rounds=options["rounds"],
        try_compile=options["try_compile"], variants=tuple(options["variants"]),
        memory_watermark=options["memory_watermark"], lanes=lanes,
        allow_reduced_precision=options["allow_reduced_precision"], **samples)


def format_table(profile: Profile) -> str:
    """The measurements as a readable table, then the choice."""
    from redbatch.gpu_worker.tuning.calibrate import CONTENDED_SHARE

    d = profile.device
    lanes = f"{d.lanes} batches at once x " if d.lanes > 1 else ""
    lines = [f"{profile.model} on {d.kind} ({d.name}, {lanes}{d.torch_threads} torch threads), "
             f"torch {profile.torch_version}",
             f"{'variant':<26} {'batch':>5} {'median_ms':>10} {'p95_ms':>9} {'img/s':>8} "
             f"{'vs eager':>8}"]
    plain = {r.batch_size: r.images_per_s for r in profile.measured[0].rows}
    for m in profile.measured:
        for i, r in enumerate(m.rows):
            ratio = f"{r.images_per_s / plain[r.batch_size]:.2f}" if plain.get(r.batch_size) \
                else "-"
            lines.append(f"{m.variant.name if i == 0 else '':<26} {r.batch_size:>5} "
                         f"{r.median_ms:>10.1f} {r.p95_ms:>9.1f} {r.images_per_s:>8.1f} "
                         f"{ratio:>8}")
        error = "" if m is profile.measured[0] or (m.output_error is None
                                                    and m.top1_agreement is None) else \
            f"; {m.fidelity()} against {profile.measured[0].variant.name}" + \
            ("" if m.faithful else " (changes answers)")
        lines.append(f"{'':<26} stopped: {m.stopped}{error}")
    c = profile.choice
    measured_sizes = {r.batch_size for m in profile.measured for r in m.rows}
    between = {s: ms for s, ms in c.latency_ms.items() if s not in measured_sizes}
    if between:
        lines.append(f"in-between sizes ({c.variant.name}): " + ", ".join(
            f"{s}: {ms:.1f} ms" for s, ms in sorted(between.items())))
    share = profile.settings.get("cpu_share")
    if share is not None:
        busy = " (contended: other processes took CPU time)" if share < CONTENDED_SHARE else ""
        lines.append(f"CPU time the timed runs got: {share:.0%} of {d.lanes * d.torch_threads}"
                     f" thread(s){busy}")
    lines.append(f"choice: {c.variant.name}, max batch {c.max_batch_size} ({c.reason}); "
                 f"preferred batch sizes: {list(c.preferred_batch_sizes) or 'none'}")
    return "\n".join(lines)
