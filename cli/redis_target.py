"""The Redis a command talks to: the one given with --redis, or a private stack without it.

Every client the CLI builds comes from ``common/redis_io.py``'s ``connect``
(timeouts on every socket): the commands' through :func:`connect_to`, which
checks the URL and prefix first; the private-stack supervisors' directly, for
URLs they made themselves. The producer's ``Client`` builds its own the same way.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
import redis
from redbatch.cli.errors import WORKER_EXTRA, WORKER_MODULES, BadInput, OrdinaryError
from redbatch.cli.local_stack import LocalStack, WorkerExited
from redbatch.cli.options import served_name
from redbatch.cli.redis_server import RedisServerError
from redbatch.common.config import RedisSettings
from redbatch.common.redis_io import connect


def missing_worker_modules() -> list[str]:
    """The worker's modules this environment lacks: [] in a worker install; all of them in a
    client-only one (``pip install redbatch``)."""
    return [name for name in WORKER_MODULES if importlib.util.find_spec(name) is None]


def connect_to(url: str, prefix: str | None = None) -> redis.Redis:
    """A client for ``url`` (with ``prefix`` checked when given); a bad URL or prefix is a
    one-line error. Connecting is lazy: the first command reaches the server."""
    try:
        settings = (RedisSettings.from_dsn(url) if prefix is None
                    else RedisSettings.from_dsn(url, prefix))
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    return connect(settings)


#: How long the private worker may take to be ready, s: loading the model (and building a
#: compiled package the first time), or with --tune calibrating it first.
READY_S = 180.0
TUNE_READY_S = 1800.0


def has_profile(model_spec: str) -> bool:
    """Whether a calibration profile of the model is stored here (any device: the worker
    picks its own); a glob of the profile directory, without loading torch."""
    from redbatch.common.config import model_name_from_spec
    from redbatch.gpu_worker.tuning.profile import DeviceInfo, default_profile_dir, profile_path

    # The device part is the name's last "--" part (a slug has single dashes only).
    path = profile_path(default_profile_dir(), model_name_from_spec(model_spec),
                        DeviceInfo("any", "any", 1))
    return any(path.parent.glob(path.name.rsplit("--", 1)[0] + "--*.json"))


@contextmanager
def redis_for(options: dict[str, Any]) -> Iterator[str]:
    """The configured Redis URL; with none, a private redis-server and local worker that
    are stopped (in that order: worker first) when the block ends."""
    tune = bool(options.get("tune"))
    if options["redis_url"]:
        if tune:
            raise OrdinaryError("--tune calibrates the private worker; with --redis, run "
                                "`redbatch calibrate` where the workers run")
        yield options["redis_url"]
        return
    missing = missing_worker_modules()
    if missing:
        raise OrdinaryError(f"without --redis this command starts a private worker, which "
                            f"needs {WORKER_EXTRA} (missing: {', '.join(missing)}); or give "
                            "--redis the URL of a Redis that workers serve")
    from redbatch.handlers.base import check_spec  # numpy, no torch: the worker extra's

    try:  # an unknown --model is refused before the stack starts, not by its worker
        check_spec(options["model_spec"])
    except ValueError as e:
        raise BadInput(str(e)) from None
    try:
        # The private worker's start-up lines would bury the command's own output.
        quiet = [] if options["log_level"].upper() == "DEBUG" else ["--log-level", "WARNING"]
        if not has_profile(options["model_spec"]):
            click.echo("redbatch: measuring this machine for the model once (--tune: a few "
                       "minutes); later runs load the profile" if tune else
                       "redbatch: no calibration profile for this model here, so the untuned "
                       "path runs; add --tune once (a few minutes) and later runs load it",
                       err=True)
        with LocalStack(options["model_spec"], served_name(options), options["prefix"],
                        quiet, calibrate="auto" if tune else "load") as stack:
            stack.wait_ready(TUNE_READY_S if tune else READY_S)
            yield stack.url
    except RedisServerError as e:
        raise click.ClickException(str(e)) from e
    except WorkerExited as e:  # its own error, if it said one, is just above
        raise OrdinaryError(f"the private worker {e}") from None
