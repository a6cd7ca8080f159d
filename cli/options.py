"""Options that more than one command takes, each defined once.

Every option can also be set by the ``REDBATCH_*`` variable its ``--help``
shows. Defaults are read from the settings dataclasses in ``common/config.py``
(:func:`default_of`), never restated, so ``--help`` shows what a worker really
uses. A command that gives a shared option a meaning of its own (another help
line, default or no variable) overrides just that when it applies the option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click
from redbatch.common.config import (
    Budget,
    ModelSettings,
    PoolSettings,
    RedisSettings,
    Settings,
    TuneSettings,
    check_redis_url,
    default_of,
    model_name_from_spec,
    parse_latency_budget,
)
from redbatch.common.logs import LOG_FORMATS
from redbatch.common.protocol import Lane

F = TypeVar("F", bound=Callable[..., Any])

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class SharedOption:
    """One option's flags, ``REDBATCH_<env>`` variable and parsing; calling it gives the
    click decorator, with ``override`` (help, default, envvar...) for one command."""

    decls: tuple[str, ...]
    env: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, **override: Any) -> Callable[[F], F]:
        """The click option, with this command's ``override`` of any keyword."""
        base: dict[str, Any] = {"show_default": True}
        if self.env is not None:
            base.update(envvar=f"REDBATCH_{self.env}", show_envvar=True)
        decorator: Callable[[F], F] = click.option(
            *self.decls, **{**base, **self.kwargs, **override})
        return decorator


def option(*decls: str, env: str | None, **kwargs: Any) -> SharedOption:
    """An option defined once: ``option("--device", env="DEVICE", default=...)``."""
    return SharedOption(decls, env, kwargs)


def opt(*decls: str, env: str | None, **kwargs: Any) -> Callable[[F], F]:
    """An option only one command takes, shown and read like the shared ones."""
    return option(*decls, env=env, **kwargs)()


def together(*decorators: Callable[[Any], Any]) -> Callable[[F], F]:
    """One decorator applying ``decorators``; --help lists the options in this order."""
    def apply(f: F) -> F:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def check_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--redis: a URL redis-py would misread is refused here, in one line, redacted."""
    try:
        return None if value is None else check_redis_url(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def served_name(options: dict[str, Any]) -> str:
    """The name the model is served under: --model-name, else derived from --model."""
    return str(options["model_name"] or model_name_from_spec(options["model_spec"]))


def url_or_default(options: dict[str, Any]) -> str:
    """--redis, else the URL a worker uses by default."""
    return str(options["redis_url"] or default_of(RedisSettings, "url"))


#: Without --redis (and REDBATCH_REDIS_URL) every command uses the worker's default URL,
#: but submit and score, which start a private Redis and worker for the run: one rule,
#: said in each command's --help.
REDIS_HELP = ("Redis URL, e.g. redis://host:6379/0, rediss://host:6380/0?ssl_ca_certs="
              "ca.pem or unix:///path/redis.sock?password=... [default: "
              f"{default_of(RedisSettings, 'url')}]")
PRIVATE_REDIS_HELP = ("Redis URL of a fleet, e.g. redis://host:6379/0 [default: none: a "
                      "private redis-server and worker are started for this run, and "
                      "stopped after it]")
REDIS = option("--redis", "redis_url", env="REDIS_URL", default=None, callback=check_url,
               show_default=False, help=REDIS_HELP)
PREFIX = option("--prefix", env="PREFIX", default=default_of(RedisSettings, "prefix"),
                help="Prefix of every Redis key.")
MODEL = option("--model", "model_spec", env="MODEL", default=default_of(ModelSettings, "spec"),
               help="Built-in model name, TorchScript file (*.pt), or 'package.module:factory'.")
MODEL_NAME = option("--model-name", env="MODEL_NAME", default=default_of(ModelSettings, "name"),
                    help="Name the model is served under (its Redis keys); default: from "
                         "--model.")
LOG_LEVEL = option("--log-level", env="LOG_LEVEL", default="INFO",
                   type=click.Choice(LOG_LEVELS, case_sensitive=False))
LOG_FORMAT = option("--log-format", env="LOG_FORMAT", default="text",
                    type=click.Choice(LOG_FORMATS),
                    help="text for people; json: one JSON object a line (ts, level, process, "
                         "logger, message, exception) for a log collector.")
LANE = option("--lane", env="LANE", type=click.Choice([lane.value for lane in Lane]),
              help="Which lane the jobs go to.")
TIMEOUT_S = option("--timeout-s", env="TIMEOUT_S", type=click.FloatRange(min=0.001))

# The device path: the worker runs it, calibrate measures it the same way.
DEVICE = option("--device", env="DEVICE", default=default_of(ModelSettings, "device"),
                help="auto, cpu, cuda or cuda:N.")
POOL_PROCESSES = option("--pool-processes", env="POOL_PROCESSES", type=click.IntRange(min=0),
                        default=default_of(PoolSettings, "processes"),
                        help="Preprocessing processes; 0: the cores the model's threads "
                             "leave, at least 1: on CUDA cores - 1, on CPU cores - lanes x "
                             "torch threads and at least a third of the cores (the worker "
                             "logs the count at start).")
TORCH_THREADS = option("--torch-threads", env="TORCH_THREADS", type=click.IntRange(min=0),
                       default=default_of(ModelSettings, "torch_threads"))
CPU_LANES = option("--cpu-lanes", env="CPU_LANES", type=click.IntRange(min=0),
                   default=default_of(ModelSettings, "cpu_lanes"))
MEMORY_WATERMARK = option("--memory-watermark", env="MEMORY_WATERMARK",
                          type=click.FloatRange(0, 0.9),
                          default=default_of(TuneSettings, "memory_watermark"))
WARMUP_TIMEOUT_S = option(
    "--warmup-timeout-s", env="WARMUP_TIMEOUT_S", type=click.FloatRange(min=0.1),
    default=default_of(Settings, "warmup_timeout_s"),
    help="A warm-up or calibration run (one batch size on every lane; the first compiles "
         "it) taking longer, seconds, means a hung device: exit (code 3).")
PROFILE_DIR = option("--profile-dir", env="PROFILE_DIR",
                     default=default_of(TuneSettings, "profile_dir"),
                     help="Calibration profiles directory (default: ~/.cache/redbatch/profiles).")
ALLOW_REDUCED_PRECISION = option(
    "--allow-reduced-precision/--faithful", env="ALLOW_REDUCED_PRECISION",
    default=default_of(TuneSettings, "allow_reduced_precision"),
    help="Let calibration choose reduced precision (bf16/fp16 autocast) for speed although "
         "it changes the plain model's top class on more than 0.5% of real samples (or "
         "was never checked on any) [default: faithful: never].")


def _budget(ctx: click.Context, param: click.Parameter, value: object) -> Budget:
    """--latency-budget-ms: "auto", "off" (or 0) or milliseconds, in one line if wrong."""
    try:
        return parse_latency_budget(str(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


LATENCY_BUDGET_MS = option(
    "--latency-budget-ms", env="LATENCY_BUDGET_MS", callback=_budget,
    default=default_of(TuneSettings, "latency_budget_ms"), metavar="auto|off|MS",
    help="What bounds the max batch: auto (sizes whose p99 at 80% load is no worse than "
         "batch 1's), off (throughput alone), or the p95 one batch may take, in ms. A worker "
         "given it chooses again from its profile's tables.")


def common_options(f: F) -> F:
    """--redis, --prefix, --model, --model-name and --log-level: what every command that
    works on one model's queues takes."""
    return together(REDIS(), PREFIX(), MODEL(), MODEL_NAME(), LOG_LEVEL())(f)


def worker_options(f: F) -> F:
    """As :func:`common_options`, with --model repeatable: one worker serves several models
    (REDBATCH_MODEL holds them separated by spaces)."""
    model = MODEL(multiple=True, default=(default_of(ModelSettings, "spec"),),
                  help="Built-in model name, TorchScript file (*.pt), or "
                       "'package.module:factory'; give it again to serve several models "
                       "from one worker (they share its pool and device).")
    return together(REDIS(), PREFIX(), model, MODEL_NAME(help=(
        "Name the model is served under (its Redis keys); default: from --model. Only "
        "with one --model.")), LOG_LEVEL())(f)


def private_stack_options(f: F) -> F:
    """As :func:`common_options`, for a command that starts a private stack without
    --redis (submit, score)."""
    return together(REDIS(help=PRIVATE_REDIS_HELP), PREFIX(), MODEL(), MODEL_NAME(),
                    LOG_LEVEL())(f)
