"""The ``redbatch`` command: worker and submit.

Every option can also be set by the ``REDBATCH_*`` variable shown in
``--help``. Options only parse; :func:`build_settings` turns them into the
one :class:`Settings` object that the worker receives.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click
import redis
from redbatch import __version__
from redbatch.common.config import (
    DEFAULT_BULK_BATCH_MS,
    DEFAULT_BULK_MAX_WAIT_MS,
    DEFAULT_BULK_SHARE,
    DEFAULT_BULK_STARVE_MS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_METRICS_HOST,
    DEFAULT_METRICS_PORT,
    DEFAULT_MODEL,
    DEFAULT_REDIS_URL,
    DEFAULT_SHM_PREFIX,
    BatchSettings,
    LimitSettings,
    ModelSettings,
    PoolSettings,
    RedisSettings,
    Settings,
    TuneSettings,
    check_redis_url,
    default_consumer_name,
    default_pool_processes,
    model_name_from_spec,
    redact_url,
)
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import DEFAULT_PREFIX, Lane

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

HELP = """redbatch: dynamic-batching PyTorch inference over Redis streams.

\b
Start a worker for the default model (EfficientNet-Lite0, ImageNet):
  redbatch worker --redis redis://localhost:6379/0
Classify photos and print one JSON line per file:
  redbatch submit --wait --redis redis://localhost:6379/0 cat.jpg photos/
Without --redis (and no REDBATCH_REDIS_URL), submit starts a private
redis-server and a local worker, and stops both when done.
Watch queues, workers and latency (once, or live):
  redbatch status --redis redis://localhost:6379/0
  redbatch top --redis redis://localhost:6379/0
"""


def _opt(*names: str, env: str, **kw: Any) -> Callable[[F], F]:
    return click.option(*names, envvar=f"REDBATCH_{env}", show_envvar=True,
                        show_default=True, **kw)


def _redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--redis: a URL redis-py would misread is refused here, in one line, redacted."""
    try:
        return None if value is None else check_redis_url(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _common_options(f: F) -> F:
    for option in reversed([
        _opt("--redis", "redis_url", env="REDIS_URL", default=None, callback=_redis_url,
             help="Redis URL, e.g. redis://host:6379/0, rediss://host:6380/0?ssl_ca_certs="
                  "ca.pem or unix:///path/redis.sock?password=..."),
        _opt("--prefix", env="PREFIX", default=DEFAULT_PREFIX, help="Prefix of every Redis key."),
        _opt("--model", "model_spec", env="MODEL", default=DEFAULT_MODEL,
             help="Built-in model name, TorchScript file (*.pt), or 'package.module:factory'."),
        _opt("--model-name", env="MODEL_NAME", default="",
             help="Name the model is served under (its Redis keys); default: from --model."),
        _opt("--log-level", env="LOG_LEVEL", default="INFO",
             type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)),
    ]):
        f = option(f)
    return f


@click.group(help=HELP)
@click.version_option(__version__, prog_name="redbatch")
def main() -> None:
    pass


# ---------------------------------------------------------------------------- worker

AUTOCAST = {"off": "", "fp16": "float16", "bf16": "bfloat16"}
#: Worker options a calibration profile may set unless they are given explicitly.
PROFILE_TUNABLE = ("max_batch_size", "max_inflight", "channels_last", "autocast", "compile")


def _tuning_options(f: F) -> F:
    """How the device path is tuned: the calibration profile and its overrides."""
    for option in reversed([
        _opt("--calibrate", env="CALIBRATE", type=click.Choice(["auto", "load", "off"]),
             default="auto",
             help="auto: load this model's and device's calibration profile, or calibrate "
                  "quickly and store one when there is none; load: only load; off: no profile."),
        _opt("--profile-dir", env="PROFILE_DIR", default="",
             help="Calibration profiles directory (default: ~/.cache/redbatch/profiles)."),
        _opt("--latency-budget-ms", env="LATENCY_BUDGET_MS", type=click.FloatRange(min=0),
             default=0.0, help="p95 batch latency allowed when calibrating, ms (0: no limit)."),
        _opt("--channels-last/--no-channels-last", env="CHANNELS_LAST", default=False,
             help="Run the model in channels_last memory format (default: the profile's)."),
        _opt("--autocast", env="AUTOCAST", type=click.Choice(sorted(AUTOCAST)), default="off",
             help="Autocast precision (default: the profile's; fp16/bf16 mainly for CUDA)."),
        _opt("--compile/--no-compile", env="COMPILE", default=False,
             help="torch.compile the model; batches are padded to the compiled sizes."),
        _opt("--memory-watermark", env="MEMORY_WATERMARK", type=click.FloatRange(0, 0.9),
             default=0.1, help="CUDA: share of device memory kept free by lowering the "
                               "batch limit."),
    ]):
        f = option(f)
    return f


def _explicit(ctx: click.Context) -> frozenset[str]:
    """Tunable options given by flag or REDBATCH_* variable, which a profile never overrides."""
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return frozenset(name for name in PROFILE_TUNABLE
                     if ctx.get_parameter_source(name) in given)



@main.command()
@_common_options
@_opt("--device", env="DEVICE", default="auto", help="auto, cpu, cuda or cuda:N.")
@_opt("--max-batch-size", env="MAX_BATCH_SIZE", type=click.IntRange(min=1),
      default=DEFAULT_MAX_BATCH_SIZE, help="Largest batch given to the model.")
@_opt("--max-wait-ms", env="MAX_WAIT_MS", type=click.FloatRange(min=0),
      default=DEFAULT_MAX_WAIT_MS,
      help="Longest the oldest request waits for its batch to fill, ms.")
@_opt("--max-inflight", env="MAX_INFLIGHT", type=click.IntRange(min=1),
      default=DEFAULT_MAX_INFLIGHT,
      help="Jobs read but not yet answered (= shared-memory slots).")
@_opt("--bulk-max-wait-ms", env="BULK_MAX_WAIT_MS", type=click.FloatRange(min=0),
      default=DEFAULT_BULK_MAX_WAIT_MS,
      help="Longest the oldest bulk request waits for its batch to fill, ms.")
@_opt("--bulk-share", env="BULK_SHARE", type=click.FloatRange(min=0.01, max=1.0),
      default=DEFAULT_BULK_SHARE,
      help="Share of a batch owed to bulk requests that went unserved for --bulk-starve-ms.")
@_opt("--bulk-starve-ms", env="BULK_STARVE_MS", type=click.FloatRange(min=0),
      default=DEFAULT_BULK_STARVE_MS,
      help="Longest waiting bulk requests go unserved before they are owed places, ms.")
@_opt("--bulk-batch-ms", env="BULK_BATCH_MS", type=click.FloatRange(min=0),
      default=DEFAULT_BULK_BATCH_MS,
      help="While interactive requests are arriving, the longest expected run time of a "
           "batch holding bulk requests, ms (0: no limit). Bounds how long interactive "
           "requests wait behind bulk work; bulk-only traffic always gets full batches.")
@_opt("--pool-processes", env="POOL_PROCESSES", type=click.IntRange(min=1),
      default=default_pool_processes(), help="Preprocessing processes (default: cores - 1).")
@_opt("--shm-prefix", env="SHM_PREFIX", default=DEFAULT_SHM_PREFIX,
      help="Start of the worker's /dev/shm names (1-12 of A-Z a-z 0-9 _); at start a worker "
           "removes what dead workers with the same prefix left there.")
@_opt("--torch-threads", env="TORCH_THREADS", type=click.IntRange(min=0), default=0,
      help="Torch intra-op threads; 0: on CPU each lane's share of the cores, on CUDA the "
           "cores minus pool processes.")
@_opt("--cpu-lanes", env="CPU_LANES", type=click.IntRange(min=0), default=0,
      help="CPU: batches run at once, each on its own thread; 0: 2 with 2 cores or more.")
@_opt("--consumer", env="CONSUMER", default="",
      help="Consumer name in the group; set a stable one to re-read own pending jobs "
           "after a restart (default: host-pid-random).")
@_opt("--result-ttl-s", env="RESULT_TTL_S", type=click.IntRange(min=1), default=600,
      help="Seconds a result is kept for its client.")
@_opt("--max-payload-bytes", env="MAX_PAYLOAD_BYTES", type=click.IntRange(min=1),
      default=DEFAULT_MAX_PAYLOAD_BYTES, help="Largest accepted payload.")
@_opt("--max-image-pixels", env="MAX_IMAGE_PIXELS", type=click.IntRange(min=1),
      default=DEFAULT_MAX_IMAGE_PIXELS, help="Largest accepted image, in pixels.")
@_opt("--reclaim-idle-ms", env="RECLAIM_IDLE_MS", type=click.IntRange(min=100), default=60_000,
      help="Take over jobs pending this long on another (dead or stuck) worker, ms.")
@_opt("--max-deliveries", env="MAX_DELIVERIES", type=click.IntRange(min=1), default=3,
      help="Deliveries after which a job is dead-lettered instead of run again.")
@_opt("--batch-timeout-s", env="BATCH_TIMEOUT_S", type=click.FloatRange(min=0.1), default=120.0,
      help="A batch running longer means a hung device: exit (code 3) for a restart.")
@_opt("--metrics-port", env="METRICS_PORT", type=click.IntRange(min=0, max=65535),
      default=DEFAULT_METRICS_PORT,
      help="Port serving /metrics (Prometheus), /healthz and /readyz; 0 turns them off.")
@_opt("--metrics-host", env="METRICS_HOST", default=DEFAULT_METRICS_HOST,
      help="Address the metrics port listens on; 0.0.0.0 for a Prometheus elsewhere "
           "(the endpoints have no authentication).")
@_opt("--burst", env="BURST", is_flag=True, default=False,
      help="Exit once the streams are empty and every job is answered.")
@_tuning_options
def worker(**options: Any) -> None:
    """Serve a model: read jobs, batch them, write results."""
    from redbatch.gpu_worker.malloc_tuning import reexec_with_malloc_tuning

    reexec_with_malloc_tuning("redbatch.cli")
    setup_logging(options["log_level"])
    options["explicit"] = _explicit(click.get_current_context())
    try:
        settings = build_settings(options)
    except ValueError as e:  # a bad --prefix, --model-name or --shm-prefix: one line
        raise click.ClickException(str(e)) from e
    from redbatch.gpu_worker.loop import Worker

    w = Worker(settings)
    with _signals_stop(w.stop, w.abort):
        try:
            w.run()
        except ValueError as e:  # a bad --model or --device: say so, without a traceback
            raise click.ClickException(str(e)) from e
    if w.device_failed:
        sys.exit(3)  # for the supervisor: restart me


def build_settings(options: dict[str, Any]) -> Settings:
    """The one Settings object, from parsed CLI options (flags or REDBATCH_* variables)."""
    spec = options["model_spec"]
    return Settings(
        redis=RedisSettings.from_dsn(options["redis_url"] or DEFAULT_REDIS_URL,
                                     options["prefix"]),
        batch=BatchSettings(max_batch_size=options["max_batch_size"],
                            max_wait_ms=options["max_wait_ms"],
                            max_inflight=max(options["max_inflight"], options["max_batch_size"]),
                            bulk_max_wait_ms=options["bulk_max_wait_ms"],
                            bulk_share=options["bulk_share"],
                            bulk_starve_ms=options["bulk_starve_ms"],
                            bulk_batch_ms=options["bulk_batch_ms"]),
        pool=PoolSettings(processes=options["pool_processes"],
                          shm_prefix=options["shm_prefix"]),
        limits=LimitSettings(max_payload_bytes=options["max_payload_bytes"],
                             max_image_pixels=options["max_image_pixels"]),
        model=ModelSettings(spec=spec, name=options["model_name"] or model_name_from_spec(spec),
                            device=options["device"], torch_threads=options["torch_threads"],
                            cpu_lanes=options.get("cpu_lanes", 0),
                            channels_last=options.get("channels_last", False),
                            autocast=AUTOCAST[options.get("autocast", "off")],
                            compile=options.get("compile", False)),
        tune=TuneSettings(calibrate=options.get("calibrate", "auto"),
                          profile_dir=options.get("profile_dir", ""),
                          latency_budget_ms=options.get("latency_budget_ms", 0.0),
                          memory_watermark=options.get("memory_watermark", 0.1),
                          explicit=options.get("explicit", frozenset())),
        consumer=options["consumer"] or default_consumer_name(),
        result_ttl_s=options["result_ttl_s"],
        burst=options["burst"],
        reclaim_idle_ms=options["reclaim_idle_ms"],
        max_deliveries=options["max_deliveries"],
        metrics_port=options["metrics_port"],
        metrics_host=options["metrics_host"],
        batch_timeout_s=options["batch_timeout_s"],
    )


@contextmanager
def _signals_stop(stop: Callable[[], None], abort: Callable[[], None]) -> Iterator[None]:
    """First SIGINT/SIGTERM: graceful stop; second: abort."""
    seen = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        logger.info("signal %s: %s", signum, "stopping" if len(seen) == 1 else "aborting")
        (stop if len(seen) == 1 else abort)()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------- calibrate


@main.command()
@click.option("--model", "model_spec", envvar="REDBATCH_MODEL", show_envvar=True,
              default=DEFAULT_MODEL, show_default=True,
              help="Built-in model name, TorchScript file (*.pt), or 'package.module:factory'.")
@_opt("--device", env="DEVICE", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--latency-budget-ms", type=click.FloatRange(min=0), default=None,
              help="Largest p95 latency of one batch, ms; sizes over it are not chosen.")
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              help="Largest batch size tried [default: 64 on CPU, 512 on CUDA; the sweep "
                   "also stops at the free-memory watermark or when throughput falls].")
@click.option("--runs", type=click.IntRange(min=1), default=7, show_default=True,
              help="Timed runs per batch size and variant.")
@click.option("--warmup-runs", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed runs per batch size and variant first.")
@click.option("--variant", "variants", multiple=True,
              help="Measure only this variant (repeatable): eager, channels_last, fp16, bf16, "
                   "compile, or a '+' combination such as channels_last+fp16.")
@click.option("--compile/--no-compile", "try_compile", default=None,
              help="Also try torch.compile [default: on CPU when a C++ compiler is installed; "
                   "5-35 s of compilation per batch size the first time, seconds after].")
@_opt("--pool-processes", env="POOL_PROCESSES", type=click.IntRange(min=1),
      default=default_pool_processes(),
      help="The worker's preprocessing processes (they decide its torch threads).")
@_opt("--torch-threads", env="TORCH_THREADS", type=click.IntRange(min=0), default=0,
      help="Torch threads to measure with; 0: what the worker would use.")
@_opt("--cpu-lanes", env="CPU_LANES", type=click.IntRange(min=0), default=0,
      help="CPU: batches run at once, as the worker runs them; 0: what the worker would use.")
@_opt("--memory-watermark", env="MEMORY_WATERMARK", type=click.FloatRange(0, 0.9),
      default=0.1, help="CUDA: share of device memory the sweep leaves free.")
@_opt("--profile-dir", env="PROFILE_DIR", default="",
      help="Where profiles are stored (default: ~/.cache/redbatch/profiles).")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Profile file to write [default: <profile dir>/<model>--<device>.json].")
@_opt("--log-level", env="LOG_LEVEL", default="WARNING",
      type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def calibrate(**options: Any) -> None:
    """Measure the model alone on the device and store its profile for `redbatch worker`.

    Times batch sizes 1, 2, 4, ... for each device-path variant, picks the smallest
    batch size reaching 95% of the peak throughput within the latency budget and the
    fastest variant, and prints the table and the choice.
    """
    from redbatch.gpu_worker.malloc_tuning import reexec_with_malloc_tuning

    reexec_with_malloc_tuning("redbatch.cli")  # measure under the worker's malloc
    setup_logging(options.pop("log_level"))
    import dataclasses

    from redbatch.gpu_worker.model import choose_torch_threads, cpu_lanes
    from redbatch.gpu_worker.tuning.calibrate import (
        CalibrationSettings,
        calibrate_to_file,
        format_table,
    )

    o = options
    settings = CalibrationSettings(
        max_batch=o["max_batch"], latency_budget_ms=o["latency_budget_ms"], runs=o["runs"],
        warmup_runs=o["warmup_runs"], try_compile=o["try_compile"],
        variants=tuple(o["variants"]), memory_watermark=o["memory_watermark"])
    from redbatch.gpu_worker.model import resolve_device

    try:
        kind = resolve_device(o["device"]).type
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    lanes = cpu_lanes(o["cpu_lanes"]) if kind == "cpu" else 1
    threads = choose_torch_threads(o["torch_threads"], o["pool_processes"], kind, lanes)
    try:
        profile, path = calibrate_to_file(
            o["model_spec"], o["device"], threads, dataclasses.replace(settings, lanes=lanes),
            Path(o["out"]) if o["out"] else None, o["profile_dir"], click.echo)
    except ValueError as e:  # a bad --model, --device or --variant
        raise click.ClickException(str(e)) from e
    click.echo(format_table(profile))
    click.echo(f"profile written to {path}")


# ---------------------------------------------------------------------------- submit


@contextmanager
def _redis_for(options: dict[str, Any]) -> Iterator[str]:
    """The configured Redis URL; with none, a private redis-server and local worker."""
    if options["redis_url"]:
        yield options["redis_url"]
        return
    from redbatch.cli.local_stack import LocalStack
    from redbatch.cli.redis_server import RedisServerError

    name = options["model_name"] or model_name_from_spec(options["model_spec"])
    try:
        # The private worker's start-up lines would bury the command's own output.
        quiet = [] if options["log_level"].upper() == "DEBUG" else ["--log-level", "WARNING"]
        with LocalStack(options["model_spec"], name, options["prefix"], quiet) as stack:
            stack.wait_ready()
            yield stack.url
    except RedisServerError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@_common_options
@click.argument("files", nargs=-1, required=True, type=click.Path())
@_opt("--wait/--no-wait", env="WAIT", default=False,
      help="Wait for and print each result (always on with a private stack).")
@_opt("--timeout-s", env="TIMEOUT_S", type=click.FloatRange(min=0.001), default=60.0,
      help="Deadline of each job and how long to wait for it, seconds.")
@_opt("--lane", env="LANE", type=click.Choice([lane.value for lane in Lane]),
      default=Lane.INTERACTIVE.value, help="Which lane the jobs go to.")
def submit(files: tuple[str, ...], wait: bool, timeout_s: float, lane: str,
           **options: Any) -> None:
    """Submit image FILES (or folders of images); print one JSON line per file."""
    setup_logging(options["log_level"])
    from redbatch.producer.inputs import iter_items
    from redbatch.producer.submit import submit_files

    name = options["model_name"] or model_name_from_spec(options["model_spec"])
    paths = [Path(item.path) for item in iter_items(files)]
    # The private stack goes away when we return, so its results are always awaited.
    wait = wait or not options["redis_url"]
    with _signals_raise(), _redis_for(options) as url:
        ok = submit_files(url, paths, model=name, prefix=options["prefix"], wait=wait,
                          timeout_s=timeout_s, lane=lane)
    sys.exit(0 if ok else 1)


# ---------------------------------------------------------------------------- score


@main.command()
@_common_options
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Output file: one record per input.")
@_opt("--format", "fmt", env="FORMAT", type=click.Choice(["jsonl", "csv"]), default=None,
      help="Output format; default: from the output's suffix (.csv), else jsonl.")
@_opt("--resume", env="RESUME", is_flag=True, default=False,
      help="Skip inputs already in the output file and append the rest.")
@_opt("--overwrite", env="OVERWRITE", is_flag=True, default=False,
      help="Replace an existing output file.")
@_opt("--window", env="WINDOW", type=click.IntRange(min=1), default=256,
      help="Jobs in flight at most.")
@_opt("--timeout-s", env="TIMEOUT_S", type=click.FloatRange(min=0.001), default=3600.0,
      help="Deadline of each job, seconds; late ones are written as 'timeout'.")
@_opt("--grace-s", env="GRACE_S", type=click.FloatRange(min=0), default=10.0,
      help="After Ctrl-C/SIGTERM, how long jobs in flight are still collected.")
@_opt("--lane", env="LANE", type=click.Choice([lane.value for lane in Lane]),
      default=Lane.BULK.value, help="Which lane the jobs go to.")
def score(inputs: tuple[str, ...], output: str, fmt: str | None, resume: bool,
          overwrite: bool, window: int, timeout_s: float, grace_s: float, lane: str,
          **options: Any) -> None:
    """Score INPUTS (images, folders, .txt or .jsonl manifests) into an output file.

    Per-input failures are records in the output; the exit code is non-zero only when
    the run could not complete (1) or was interrupted (130; rerun with --resume).
    """
    setup_logging(options["log_level"])
    from redbatch.producer.bulk import ScoreSettings
    from redbatch.producer.inputs import ManifestError

    fmt = fmt or ("csv" if output.lower().endswith(".csv") else "jsonl")
    if Path(output).exists() and not (resume or overwrite):
        raise click.ClickException(f"{output} exists: use --resume to finish it or "
                                   "--overwrite to replace it")
    settings = ScoreSettings(window=window, lane=Lane(lane), timeout_s=timeout_s,
                             grace_s=grace_s)
    existed = Path(output).exists()
    try:
        complete = _score(inputs, output, fmt, resume, settings, options)
    except ManifestError as e:
        _remove_if_empty(output, fmt, existed)
        raise click.ClickException(str(e)) from e
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise click.ClickException(f"lost the connection to Redis: {e}; the output holds "
                                   "what was finished, rerun with --resume") from e
    except redis.ResponseError as e:  # NOPERM, OOM, READONLY...: said by Redis, one line
        raise click.ClickException(f"Redis refused: {e}; the output holds what was "
                                   "finished, rerun with --resume") from e
    sys.exit(0 if complete else 130)


def _remove_if_empty(output: str, fmt: str, existed: bool) -> None:
    """A run that failed before writing any record leaves no output file behind."""
    path = Path(output)
    if existed or not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    if lines == 0 or (fmt == "csv" and lines == 1):  # nothing, or the CSV header alone
        path.unlink()


def _score(inputs: tuple[str, ...], output: str, fmt: str, resume: bool,
           settings: Any, options: dict[str, Any]) -> bool:
    from redbatch.cli.local_stack import count_consumers
    from redbatch.producer.bulk import BulkScorer
    from redbatch.producer.client import Client
    from redbatch.producer.inputs import count_items, iter_items
    from redbatch.producer.output import DoneIndex, OutputWriter
    from redbatch.producer.progress import Progress

    done = DoneIndex.from_output(output, fmt) if resume else DoneIndex.empty()
    name = options["model_name"] or model_name_from_spec(options["model_spec"])
    with _signals_raise(), _redis_for(options) as url, \
            Client(url, model=name, prefix=options["prefix"]) as client:
        if count_consumers(client.redis, client.keys()) == 0:
            logger.warning("no worker is serving model %r yet; jobs wait in Redis until one "
                           "starts", name)
        writer = OutputWriter(output, fmt, append=resume)
        scorer = BulkScorer(client, writer, settings, done)
        scorer.progress = progress = Progress(scorer.stats)
        threading.Thread(target=lambda: setattr(progress, "total", count_items(inputs)),
                         name="count-inputs", daemon=True).start()
        try:
            with _signals_stop(scorer.stop, scorer.stop):
                complete = scorer.run(iter_items(inputs))
        finally:
            writer.close()
            click.echo(scorer.stats.summary(), err=True)
    return complete


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so the local stack is torn down on both."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------- limit


@main.command()
@_common_options
@click.option("--lane", type=click.Choice([lane.value for lane in Lane]), default=None,
              help="The lane to bound or clear (required with --max-jobs or --clear).")
@click.option("--max-jobs", type=click.IntRange(min=0), default=None,
              help="Most jobs the lane's queue may hold (queued or in progress); a submit "
                   "past it fails with queue_full. 0 refuses every job.")
@click.option("--clear", is_flag=True, default=False, help="Remove the lane's bound.")
def limit(lane: str | None, max_jobs: int | None, clear: bool, **options: Any) -> None:
    """Bound a lane's queue (admission control), clear the bound, or show both lanes.

    Prints one JSON line per lane: its bound (null: unbounded) and the jobs its queue holds.
    Without --redis, the worker's default Redis URL is used.
    """
    import json

    from redbatch.producer.client import Client

    setup_logging(options["log_level"])
    if max_jobs is not None and clear:
        raise click.UsageError("give either --max-jobs or --clear, not both")
    if (max_jobs is not None or clear) and lane is None:
        raise click.UsageError("--max-jobs and --clear need --lane")
    name = options["model_name"] or model_name_from_spec(options["model_spec"])
    try:
        with Client(options["redis_url"] or DEFAULT_REDIS_URL, model=name,
                    prefix=options["prefix"]) as client:
            if lane is not None and (max_jobs is not None or clear):
                client.set_queue_limit(lane, max_jobs)
            for state in (client.queue_state(each) for each in Lane):
                click.echo(json.dumps({"model": name, "lane": state.lane.value,
                                       "max_jobs": state.bound, "queued": state.queued}))
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise click.ClickException(f"cannot reach Redis: {e}") from e


# ---------------------------------------------------------------------------- dlq


@main.group()
def dlq() -> None:
    """Look at and replay dead letters (jobs that will not run again)."""


def _dlq_target(options: dict[str, Any]) -> tuple[redis.Redis, Any]:
    from redbatch.common.protocol import Keys

    if not options["redis_url"]:
        raise click.ClickException("--redis (or REDBATCH_REDIS_URL) is required")
    name = options["model_name"] or model_name_from_spec(options["model_spec"])
    return redis.Redis.from_url(options["redis_url"]), Keys(name, options["prefix"])


@dlq.command("list")
@_common_options
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many.")
def dlq_list(limit: int | None, **options: Any) -> None:
    """Print one JSON line per dead letter, oldest first."""
    import json

    from redbatch.producer import dlq as dead_letters

    r, keys = _dlq_target(options)
    for entry in dead_letters.entries(r, keys, limit):
        click.echo(json.dumps(entry))


@dlq.command("retry")
@_common_options
@click.argument("ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Retry every dead letter.")
def dlq_retry(ids: tuple[str, ...], everything: bool, **options: Any) -> None:
    """Requeue the dead letters IDS (as `dlq list` shows them), or --all."""
    from redbatch.producer import dlq as dead_letters

    if not ids and not everything:
        raise click.UsageError("name dead-letter IDS or pass --all")
    r, keys = _dlq_target(options)
    try:
        click.echo(f"requeued {dead_letters.retry(r, keys, list(ids))}")
    except dead_letters.RetryQueueFull as e:
        click.echo(f"requeued {e.requeued}")
        raise click.ClickException(str(e)) from e


@dlq.command("purge")
@_common_options
@click.argument("ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Delete every dead letter.")
def dlq_purge(ids: tuple[str, ...], everything: bool, **options: Any) -> None:
    """Delete the dead letters IDS, or --all."""
    from redbatch.producer import dlq as dead_letters

    if not ids and not everything:
        raise click.UsageError("name dead-letter IDS or pass --all")
    r, keys = _dlq_target(options)
    click.echo(f"deleted {dead_letters.purge(r, keys, list(ids))}")


# ---------------------------------------------------------------------------- status, top

NEEDS_REDIS = ("{command} looks at a running fleet: give its Redis with --redis URL or "
               "REDBATCH_REDIS_URL")


def _status_options(f: F) -> F:
    for option in reversed([
        _opt("--redis", "redis_url", env="REDIS_URL", default=None, callback=_redis_url,
             help="Redis URL of the fleet, e.g. redis://host:6379/0."),
        _opt("--prefix", env="PREFIX", default=DEFAULT_PREFIX, help="Prefix of every Redis key."),
        _opt("--model", "--model-name", "models", env="MODEL_NAME", multiple=True,
             help="Served model name to show (repeatable); default: every model found."),
    ]):
        f = option(f)
    return f


def _status_redis(command: str, options: dict[str, Any]) -> redis.Redis:
    from redbatch.common.protocol import validate_name
    from redbatch.common.redis_io import connect

    # A private redis-server (as submit starts) would hold nothing worth looking at.
    if not options["redis_url"]:
        raise click.ClickException(NEEDS_REDIS.format(command=f"redbatch {command}"))
    try:
        for name in options["models"]:
            validate_name(name)
        return connect(RedisSettings.from_dsn(options["redis_url"], options["prefix"]))
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@_status_options
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON, not a table.")
def status(as_json: bool, **options: Any) -> None:
    """Print queues, workers and recent results of each model and lane, once."""
    import json

    from redbatch.cli.fleet_state import gather
    from redbatch.cli.fleet_view import render

    r = _status_redis("status", options)
    try:
        fleet = gather(r, options["prefix"], options["models"])
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise click.ClickException(f"cannot reach Redis: {e}") from e
    click.echo(json.dumps(fleet.to_dict()) if as_json else render(fleet), nl=as_json)


@main.command()
@_status_options
@_opt("--interval", env="TOP_INTERVAL_S", type=click.FloatRange(min=0.1), default=1.0,
      help="Seconds between redraws.")
def top(interval: float, **options: Any) -> None:
    """Show `redbatch status` live, redrawn every --interval seconds; Ctrl-C quits."""
    from redbatch.cli.fleet_view import run_top

    r = _status_redis("top", options)
    with _signals_raise():  # SIGTERM too leaves the terminal as it was
        run_top(_top_frames(r, options["prefix"], options["models"]), interval, sys.stdout)


def _top_frames(r: redis.Redis, prefix: str, models: tuple[str, ...]) -> Callable[[], str]:
    """One frame per call; models are looked up (a SCAN) every 10 s, not every frame."""
    import time

    from redbatch.cli.fleet_state import discover_models, gather
    from redbatch.cli.fleet_view import render

    found: list[str] = []
    found_at = float("-inf")

    def frame() -> str:
        nonlocal found, found_at
        try:
            if not models and time.monotonic() - found_at > 10:
                found, found_at = discover_models(r, prefix), time.monotonic()
            return render(gather(r, prefix, models or found))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            return f"redbatch top: cannot reach Redis ({e}); retrying\n"

    return frame


# ---------------------------------------------------------------------------- acl

ACL_PASSWORD_HINT = ("--apply shows no password: give --producer-password and "
                     "--worker-password (or REDBATCH_ACL_PRODUCER_PASSWORD and "
                     "REDBATCH_ACL_WORKER_PASSWORD)")


@main.command()
@click.option("--model", "models", multiple=True, required=True,
              help="Served model name the users are for (repeatable).")
@_opt("--prefix", env="PREFIX", default=DEFAULT_PREFIX, help="Prefix of every Redis key.")
@click.option("--role", "roles", multiple=True, type=click.Choice(["producer", "worker"]),
              help="Which users to make (repeatable) [default: both].")
@_opt("--producer-user", env="ACL_PRODUCER_USER", default="redbatch-producer",
      help="User name of the producer.")
@_opt("--worker-user", env="ACL_WORKER_USER", default="redbatch-worker",
      help="User name of the worker.")
@_opt("--producer-password", env="ACL_PRODUCER_PASSWORD", default=None,
      help="The producer's password (prefer the variable: options show in ps); "
           "default: a random one, shown once.")
@_opt("--worker-password", env="ACL_WORKER_PASSWORD", default=None,
      help="The worker's password; default: a random one, shown once.")
@click.option("--format", "fmt", type=click.Choice(["setuser", "aclfile"]), default="setuser",
              show_default=True,
              help="ACL SETUSER commands (pipe them into redis-cli) or ACL file lines.")
@click.option("--apply", "apply_", is_flag=True, default=False,
              help="Create the users on --redis (an admin connection) instead of printing.")
@_opt("--redis", "redis_url", env="REDIS_URL", default=None, callback=_redis_url,
      help="Admin URL of the Redis the users are for: needed by --apply; without it the "
           "rules are for Redis 7.2 or later, and the printed URLs name localhost.")
def acl(models: tuple[str, ...], prefix: str, roles: tuple[str, ...], fmt: str, apply_: bool,
        redis_url: str | None, **names: str | None) -> None:
    """Print (or --apply) least-privilege Redis ACL users for producers and workers.

    A producer may submit jobs and read, await and delete results of the --model(s) and
    nothing else: no writing results or done tokens, no other model, no admin command.
    A worker may do what a worker does, for those models only. The rules keep only each
    password's SHA-256 (#<hash>), so they can be stored. The URL to connect with goes to
    stderr, with the password only when it was generated here. Needs Redis 7.0 or later.
    """
    import secrets

    from redbatch.cli import acl_rules as rules
    from redbatch.common.protocol import Keys

    if apply_ and not redis_url:
        raise click.UsageError("--apply needs --redis: an admin user's URL")
    wanted = [rules.Role(role) for role in dict.fromkeys(roles or ("producer", "worker"))]
    given = {role: names[f"{role.value}_password"] for role in wanted}
    if apply_ and None in given.values():
        raise click.UsageError(ACL_PASSWORD_HINT)
    passwords = {role: given[role] or secrets.token_urlsafe(24) for role in wanted}
    admin = _acl_admin(redis_url)
    try:
        version = rules.server_version(admin) if admin else rules.SETINFO_SINCE
        keys = [Keys(model, prefix) for model in dict.fromkeys(models)]
        users = [rules.build_user(str(names[f"{role.value}_user"]), role, passwords[role],
                                  keys, version) for role in wanted]
        for user in users:
            if admin is not None and apply_:
                rules.apply(admin, user)
            else:
                click.echo(user.setuser_line() if fmt == "setuser" else user.aclfile_line())
            shown = None if given[user.role] else passwords[user.role]
            click.echo(_acl_note(user, models, rules.user_url(redis_url, user.name, shown),
                                 apply_), err=not apply_)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    except redis.exceptions.NoPermissionError as e:
        raise click.ClickException(f"NOPERM: {e}; --redis must be an admin user's URL "
                                   f"(it is {redact_url(str(redis_url))})") from e
    except redis.RedisError as e:
        raise click.ClickException(f"Redis at {redact_url(str(redis_url))} refused: {e}") from e


def _acl_admin(url: str | None) -> redis.Redis | None:
    """An admin connection to ``url`` (None without one); one line when it fails."""
    if url is None:
        return None
    from redbatch.common.redis_io import connect

    r = connect(RedisSettings.from_dsn(url))
    try:
        r.ping()
    except redis.RedisError as e:
        raise click.ClickException(f"cannot reach Redis at {redact_url(url)}: {e}") from e
    return r


def _acl_note(user: Any, models: tuple[str, ...], url: str, applied: bool) -> str:
    what = f"ACL user {user.name} ({user.role.value} of {', '.join(models)})"
    hint = "" if ":***@" not in url else " (*** is the password you gave)"
    if applied:
        return f"applied {what}: connect with {url}{hint}"
    return f"# {what}: connect with {url}{hint or ' (a generated password, shown once)'}"

