"""``redbatch status`` and ``redbatch top``: a running fleet's queues, workers and latency.

``fleet_state.py`` reads it from Redis, ``fleet_view.py`` draws it; ``status``
prints one frame (or JSON), ``top`` redraws until Ctrl-C.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click
import redis
from redbatch.cli import options as o
from redbatch.cli.fleet_state import discover_models, gather
from redbatch.cli.fleet_view import render, run_top
from redbatch.cli.redis_target import connect_to
from redbatch.cli.signals import signals_raise
from redbatch.common.protocol import validate_name

#: Seconds between looks for new models (a SCAN) when top shows every model.
DISCOVER_EVERY_S = 10.0

_fleet_options = o.together(
    o.REDIS(),
    o.PREFIX(),
    # Served names, not a model to load (--model elsewhere): both spellings mean it here.
    o.opt("--model", "--model-name", "models", env="MODEL_NAME", multiple=True,
          help="Served model name to show (repeatable); default: every model found."),
)


def _fleet_redis(options: dict[str, Any]) -> redis.Redis:
    """A client for the fleet's --redis (the worker's default URL without one); one line
    for a bad name."""
    try:
        for name in options["models"]:
            validate_name(name)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    return connect_to(o.url_or_default(options), options["prefix"])


@click.command()
@_fleet_options
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON, not a table.")
def status(as_json: bool, **options: Any) -> None:
    """Print queues, workers and recent results of each model and lane, once."""
    r = _fleet_redis(options)
    fleet = gather(r, options["prefix"], options["models"])  # unreachable: cli/errors.py
    click.echo(json.dumps(fleet.to_dict()) if as_json else render(fleet), nl=as_json)


@click.command()
@_fleet_options
@o.opt("--interval", env="TOP_INTERVAL_S", type=click.FloatRange(min=0.1), default=1.0,
       help="Seconds between redraws.")
def top(interval: float, **options: Any) -> None:
    """Show `redbatch status` live, redrawn every --interval seconds; Ctrl-C quits."""
    r = _fleet_redis(options)
    with signals_raise():  # SIGTERM too leaves the terminal as it was
        run_top(_top_frames(r, options["prefix"], options["models"]), interval, sys.stdout)


def _top_frames(r: redis.Redis, prefix: str, models: tuple[str, ...]) -> Callable[[], str]:
    """One frame per call; models are looked up every DISCOVER_EVERY_S, not every frame."""
    found: list[str] = []
    found_at = float("-inf")

    def frame() -> str:
        nonlocal found, found_at
        try:
            if not models and time.monotonic() - found_at > DISCOVER_EVERY_S:
                found, found_at = discover_models(r, prefix), time.monotonic()
            return render(gather(r, prefix, models or found))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            return f"redbatch top: cannot reach Redis ({e}); retrying\n"

    return frame
