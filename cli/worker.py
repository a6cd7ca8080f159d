"""``redbatch worker``: serve a model. Options only parse; :func:`build_settings` turns
them into the one :class:`Settings` object the worker receives.

Every default comes from the settings dataclasses (``common/config.py``), read
with :func:`default_of`.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, Protocol

import click
from redbatch.cli import options as o
from redbatch.cli.errors import Interrupted
from redbatch.cli.options import opt, together
from redbatch.cli.signals import signals_stop
from redbatch.common.config import (
    GENERATION_MODELS,
    BatchSettings,
    GenerationSettings,
    LimitSettings,
    ModelSettings,
    PoolSettings,
    RedisSettings,
    Settings,
    TuneSettings,
    default_consumer_name,
    default_of,
)
from redbatch.common.logs import setup_logging
from redbatch.common.redis_io import RedisUnavailable

logger = logging.getLogger(__name__)

#: --autocast's choices: the flag's word for each ModelSettings.autocast dtype.
AUTOCAST = {"off": "", "fp16": "float16", "bf16": "bfloat16"}
_AUTOCAST_WORD = {dtype: word for word, dtype in AUTOCAST.items()}

_batch_options = together(
    opt("--max-batch-size", env="MAX_BATCH_SIZE", type=click.IntRange(min=1),
        default=default_of(BatchSettings, "max_batch_size"),
        help="Largest batch given to the model."),
    opt("--max-batch-tokens", env="MAX_BATCH_TOKENS", type=click.IntRange(min=0),
        default=default_of(BatchSettings, "max_batch_tokens"),
        help="A model whose inputs have a length (all_minilm_l6_v2: tokens): most padded "
             "tokens a batch holds (rows x its longest), requests grouped by length; 0: "
             "plain size batching, padded to the longest."),
    opt("--max-wait-ms", env="MAX_WAIT_MS", type=click.FloatRange(min=0),
        default=default_of(BatchSettings, "max_wait_ms"),
        help="Longest the oldest request waits for its batch to fill, ms."),
    opt("--max-inflight", env="MAX_INFLIGHT", type=click.IntRange(min=1),
        default=default_of(BatchSettings, "max_inflight"),
        help="Jobs read but not yet answered (= shared-memory slots)."),
    opt("--bulk-max-wait-ms", env="BULK_MAX_WAIT_MS", type=click.FloatRange(min=0),
        default=default_of(BatchSettings, "bulk_max_wait_ms"),
        help="Longest the oldest bulk request waits for its batch to fill, ms."),
    opt("--bulk-share", env="BULK_SHARE", type=click.FloatRange(min=0.01, max=1.0),
        default=default_of(BatchSettings, "bulk_share"),
        help="Share of a batch owed to bulk requests that went unserved for --bulk-starve-ms."),
    opt("--bulk-starve-ms", env="BULK_STARVE_MS", type=click.FloatRange(min=0),
        default=default_of(BatchSettings, "bulk_starve_ms"),
        help="Longest waiting bulk requests go unserved before they are owed places, ms."),
    opt("--bulk-batch-ms", env="BULK_BATCH_MS", type=click.FloatRange(min=0),
        default=default_of(BatchSettings, "bulk_batch_ms"),
        help="While interactive requests are arriving, the longest expected run time of a "
             "batch holding bulk requests, ms (0: no limit). Bounds how long interactive "
             "requests wait behind bulk work; bulk-only traffic always gets full batches."),
)

_process_options = together(
    o.POOL_PROCESSES(),
    opt("--pool-prefetch-ms", env="POOL_PREFETCH_MS", type=click.FloatRange(min=0.1),
        default=default_of(PoolSettings, "prefetch_ms"),
        help="Preprocessing queued to each pool process at a time, ms of its recent pace: "
             "more keeps many processes busy while the worker refills them (and sends more "
             "tasks a message); less keeps urgent tasks from queueing behind bulk ones."),
    opt("--shm-prefix", env="SHM_PREFIX", default=default_of(PoolSettings, "shm_prefix"),
        help="Start of the worker's /dev/shm names (1-12 of A-Z a-z 0-9 _); at start a worker "
             "removes what dead workers with the same prefix left there."),
    o.TORCH_THREADS(help="Torch intra-op threads; 0: on CPU each lane's share of the cores, "
                         "on CUDA the cores minus pool processes."),
    o.CPU_LANES(help="CPU: batches run at once, each on its own thread; 0: 2 with 2 cores "
                     "or more."),
    opt("--consumer", env="CONSUMER", default="",
        help="Consumer name in the group; set a stable one to re-read own pending jobs "
             "after a restart (default: host-pid-random)."),
)

_job_options = together(
    opt("--result-ttl-s", env="RESULT_TTL_S", type=click.IntRange(min=1),
        default=default_of(Settings, "result_ttl_s"),
        help="Seconds a result is kept for its client."),
    opt("--max-payload-bytes", env="MAX_PAYLOAD_BYTES", type=click.IntRange(min=1),
        default=default_of(LimitSettings, "max_payload_bytes"), help="Largest accepted payload."),
    opt("--max-image-pixels", env="MAX_IMAGE_PIXELS", type=click.IntRange(min=1),
        default=default_of(LimitSettings, "max_image_pixels"),
        help="Largest accepted image, in pixels."),
    opt("--reclaim-idle-ms", env="RECLAIM_IDLE_MS", type=click.IntRange(min=100),
        default=default_of(Settings, "reclaim_idle_ms"),
        help="Take over jobs pending this long on another (dead or stuck) worker, ms."),
    opt("--max-deliveries", env="MAX_DELIVERIES", type=click.IntRange(min=1),
        default=default_of(Settings, "max_deliveries"),
        help="Deliveries after which a job is dead-lettered instead of run again."),
    opt("--batch-timeout-s", env="BATCH_TIMEOUT_S", type=click.FloatRange(min=0.1),
        default=default_of(Settings, "batch_timeout_s"),
        help="A batch running longer means a hung device: exit (code 3) for a restart."),
    o.WARMUP_TIMEOUT_S(),
    opt("--result-replicas", env="RESULT_REPLICAS", type=click.IntRange(min=0),
        default=default_of(Settings, "result_replicas"),
        help="After each write of results, wait (Redis WAIT) for this many replicas to "
             "have it, so a failover is less likely to lose it; 0: do not wait."),
    opt("--result-wait-ms", env="RESULT_WAIT_MS", type=click.IntRange(min=1),
        default=default_of(Settings, "result_wait_ms"),
        help="The longest that wait takes, ms; then the worker goes on (the results are "
             "written on the master) and counts it as short in the metrics."),
)

_serve_options = together(
    opt("--metrics-port", env="METRICS_PORT", type=click.IntRange(min=0, max=65535),
        default=default_of(Settings, "metrics_port"),
        help="Port serving /metrics (Prometheus), /healthz and /readyz; 0 turns them off."),
    opt("--metrics-host", env="METRICS_HOST", default=default_of(Settings, "metrics_host"),
        help="Address the metrics port listens on; 0.0.0.0 for a Prometheus elsewhere "
             "(the endpoints have no authentication)."),
    opt("--burst", env="BURST", is_flag=True, default=default_of(Settings, "burst"),
        help="Exit once the streams are empty and every job is answered."),
)

#: How the device path is tuned: the calibration profile and its overrides.
_tuning_options = together(
    opt("--calibrate", env="CALIBRATE", type=click.Choice(TuneSettings.CALIBRATE_MODES),
        default=default_of(TuneSettings, "calibrate"),
        help="auto: load this model's and device's calibration profile, or calibrate "
             "quickly and store one when there is none; load: only load; off: no profile."),
    o.PROFILE_DIR(),
    o.LATENCY_BUDGET_MS(),
    o.ALLOW_REDUCED_PRECISION(),
    opt("--channels-last/--no-channels-last", env="CHANNELS_LAST",
        default=default_of(ModelSettings, "channels_last"), show_default=False,
        help="Run the model in channels_last memory format [default: the calibration "
             "profile's; without one, off]."),
    opt("--autocast", env="AUTOCAST", type=click.Choice(sorted(AUTOCAST)),
        default=_AUTOCAST_WORD[default_of(ModelSettings, "autocast")], show_default=False,
        help="Autocast precision, fp16/bf16 mainly for CUDA [default: the calibration "
             "profile's; without one, off]."),
    opt("--compile/--no-compile", env="COMPILE", default=default_of(ModelSettings, "compile"),
        show_default=False,
        help="torch.compile the model; batches are padded to the compiled sizes [default: "
             "the calibration profile's; without one, off]."),
    o.MEMORY_WATERMARK(help="CUDA: share of device memory kept free by lowering the "
                            "batch limit."),
)

#: A chat model's (smollm2_135m) continuous batching; the other models ignore them.
_generation_options = together(
    opt("--max-running", env="MAX_RUNNING", type=click.IntRange(min=1, max=1024),
        default=default_of(GenerationSettings, "max_running"),
        help="Chat models: sequences in the running batch, at most."),
    opt("--kv-memory-mib", env="KV_MEMORY_MIB", type=click.IntRange(min=1),
        default=default_of(GenerationSettings, "kv_memory_mib"),
        help="Chat models: memory of the KV cache, MiB; a job that cannot fit it whole is "
             "answered too_many_tokens."),
    opt("--max-new-tokens", env="MAX_NEW_TOKENS", type=click.IntRange(min=1, max=8192),
        default=default_of(GenerationSettings, "max_new_tokens"),
        help="Chat models: the largest max_new_tokens a job may ask for."),
    opt("--stream-interval-ms", env="STREAM_INTERVAL_MS", type=click.FloatRange(min=0),
        default=default_of(GenerationSettings, "stream_interval_ms"),
        help="Chat models: a request's tokens are gathered this long into one token-stream "
             "chunk, ms; 0 writes every step."),
)


@click.command()
@o.worker_options
@o.DEVICE()
@_batch_options
@_process_options
@_job_options
@_serve_options
@_tuning_options
@_generation_options
@o.LOG_FORMAT()
def worker(**options: Any) -> None:
    """Serve a model (or several: --model A --model B): read jobs, batch them, write
    results."""
    from redbatch.gpu_worker.device.malloc_tuning import reexec_with_malloc_tuning

    reexec_with_malloc_tuning("redbatch.cli")
    setup_logging(options["log_level"], options.pop("log_format"))
    options["explicit"] = _explicit(click.get_current_context())
    try:
        settings = build_settings(options)
    except ValueError as e:  # a bad --prefix, --model-name or --shm-prefix: one line
        raise click.ClickException(str(e)) from e
    # Imported here: torch loads with it, which the other commands never need.
    from redbatch.gpu_worker.device.watchdog import DEVICE_EXIT_CODE, exit_now
    from redbatch.gpu_worker.worker import Worker

    served: _Served
    if settings.model.spec in GENERATION_MODELS and not settings.more_models:
        from redbatch.gpu_worker.generating import GenerationWorker

        served = GenerationWorker(settings)
    else:
        served = Worker(settings)
    _serve(served)
    if served.device_failed:
        # For the supervisor: restart me. Not sys.exit: a lane thread stuck in the device
        # would keep the interpreter from exiting (NOTE [ Device watchdog ]).
        exit_now(DEVICE_EXIT_CODE)


class _Served(Protocol):
    """What ``_serve`` runs: a Worker or a GenerationWorker."""

    @property
    def device_failed(self) -> bool: ...

    def run(self) -> None: ...
    def stop(self) -> None: ...
    def abort(self) -> None: ...


def _serve(w: _Served) -> None:
    """Run ``w`` until SIGINT/SIGTERM stops it (a second one aborts). Stopped before Redis
    ever answered, it read nothing: Ctrl-C exits 130, as every command says it, and SIGTERM,
    a supervisor's orderly stop, 0."""
    with signals_stop(w.stop, w.abort) as seen:
        try:
            w.run()
        except ValueError as e:  # a bad --model or --device: say so, without a traceback
            raise click.ClickException(str(e)) from e
        except RedisUnavailable:  # stopped before Redis answered
            if signal.SIGINT in seen:
                raise Interrupted("interrupted while waiting for Redis") from None
            if not seen:
                raise
            logger.info("stopped while waiting for Redis: nothing was read")


def _explicit(ctx: click.Context) -> frozenset[str]:
    """Tunable options given by flag or REDBATCH_* variable, which a profile never overrides."""
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return frozenset(name for name in TuneSettings.TUNABLE
                     if ctx.get_parameter_source(name) in given)


def build_settings(options: dict[str, Any]) -> Settings:
    """The one Settings object, from the worker's parsed options (flags or REDBATCH_*
    variables); ValueError for a bad URL, prefix, model name or shm prefix, or a model
    given twice."""
    models = _model_settings(options)
    return Settings(
        redis=RedisSettings.from_dsn(o.url_or_default(options), options["prefix"]),
        batch=BatchSettings(max_batch_size=options["max_batch_size"],
                            max_batch_tokens=options["max_batch_tokens"],
                            max_wait_ms=options["max_wait_ms"],
                            max_inflight=max(options["max_inflight"], options["max_batch_size"]),
                            bulk_max_wait_ms=options["bulk_max_wait_ms"],
                            bulk_share=options["bulk_share"],
                            bulk_starve_ms=options["bulk_starve_ms"],
                            bulk_batch_ms=options["bulk_batch_ms"]),
        pool=PoolSettings(processes=options["pool_processes"],
                          prefetch_ms=options["pool_prefetch_ms"],
                          shm_prefix=options["shm_prefix"]),
        limits=LimitSettings(max_payload_bytes=options["max_payload_bytes"],
                             max_image_pixels=options["max_image_pixels"]),
        model=models[0],
        more_models=models[1:],
        tune=TuneSettings(calibrate=options["calibrate"], profile_dir=options["profile_dir"],
                          latency_budget_ms=options["latency_budget_ms"],
                          memory_watermark=options["memory_watermark"],
                          allow_reduced_precision=options["allow_reduced_precision"],
                          explicit=options.get("explicit", default_of(TuneSettings, "explicit"))),
        consumer=options["consumer"] or default_consumer_name(),
        result_ttl_s=options["result_ttl_s"],
        burst=options["burst"],
        reclaim_idle_ms=options["reclaim_idle_ms"],
        max_deliveries=options["max_deliveries"],
        metrics_port=options["metrics_port"],
        metrics_host=options["metrics_host"],
        batch_timeout_s=options["batch_timeout_s"],
        warmup_timeout_s=options["warmup_timeout_s"],
        result_replicas=options["result_replicas"],
        result_wait_ms=options["result_wait_ms"],
        generation=GenerationSettings(max_running=options["max_running"],
                                      kv_memory_mib=options["kv_memory_mib"],
                                      max_new_tokens=options["max_new_tokens"],
                                      stream_interval_ms=options["stream_interval_ms"]),
    )


def _model_settings(options: dict[str, Any]) -> tuple[ModelSettings, ...]:
    """What to serve and how to run it, from the worker's parsed options: one ModelSettings
    per --model, in order, the device options the same for each."""
    specs = options["model_spec"]
    specs = (specs,) if isinstance(specs, str) else tuple(specs)
    if len(specs) > 1 and options["model_name"]:
        raise ValueError("--model-name names one model: with several --model, each is "
                         "served under the name its --model gives")
    return tuple(ModelSettings(spec=spec, name=o.served_name({**options, "model_spec": spec}),
                               device=options["device"], torch_threads=options["torch_threads"],
                               cpu_lanes=options["cpu_lanes"],
                               channels_last=options["channels_last"],
                               autocast=AUTOCAST[options["autocast"]], compile=options["compile"])
                 for spec in specs)
