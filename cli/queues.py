"""``redbatch limit`` and ``redbatch dlq``: a model's queues, bounded and dead-lettered.

``limit`` bounds a lane's queue (admission control) through the producer's
:class:`Client`; ``dlq`` lists, replays and deletes dead letters through
``producer/dlq.py``. Both act on one model's keys.
"""

from __future__ import annotations

import json
from typing import Any

import click
import redis
from redbatch.cli import options as o
from redbatch.cli.redis_target import connect_to
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import Keys, Lane
from redbatch.producer import dlq as dead_letters
from redbatch.producer.client import Client


@click.command()
@o.common_options
@o.LANE(envvar=None, default=None,
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
    setup_logging(options["log_level"])
    if max_jobs is not None and clear:
        raise click.UsageError("give either --max-jobs or --clear, not both")
    if (max_jobs is not None or clear) and lane is None:
        raise click.UsageError("--max-jobs and --clear need --lane")
    name = o.served_name(options)
    # An unreachable Redis is one line: the group's handler (cli/errors.py) says it.
    with Client(o.url_or_default(options), model=name, prefix=options["prefix"]) as client:
        if lane is not None and (max_jobs is not None or clear):
            client.set_queue_limit(lane, max_jobs)
        for state in (client.queue_state(each) for each in Lane):
            click.echo(json.dumps({"model": name, "lane": state.lane.value,
                                   "max_jobs": state.bound, "queued": state.queued}))


@click.group()
def dlq() -> None:
    """Look at and replay dead letters (jobs that will not run again)."""


def _dlq_target(options: dict[str, Any]) -> tuple[redis.Redis, Keys]:
    """A client for --redis (the worker's default URL without one) and the model's keys."""
    r = connect_to(o.url_or_default(options), options["prefix"])
    return r, Keys(o.served_name(options), options["prefix"])


#: Every dead letter instead of the IDS named (retry, purge).
_ALL = o.option("--all", "everything", env=None, is_flag=True)


@dlq.command("list")
@o.common_options
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many.")
def dlq_list(limit: int | None, **options: Any) -> None:
    """Print one JSON line per dead letter, oldest first."""
    r, keys = _dlq_target(options)
    for entry in dead_letters.entries(r, keys, limit):
        click.echo(json.dumps(entry))


@dlq.command("retry")
@o.common_options
@click.argument("ids", nargs=-1)
@_ALL(help="Retry every dead letter.")
def dlq_retry(ids: tuple[str, ...], everything: bool, **options: Any) -> None:
    """Requeue the dead letters IDS (as `dlq list` shows them), or --all."""
    if not ids and not everything:
        raise click.UsageError("name dead-letter IDS or pass --all")
    r, keys = _dlq_target(options)
    try:
        click.echo(f"requeued {dead_letters.retry(r, keys, list(ids))}")
    except dead_letters.RetryQueueFull as e:
        click.echo(f"requeued {e.requeued}")
        raise click.ClickException(str(e)) from e


@dlq.command("purge")
@o.common_options
@click.argument("ids", nargs=-1)
@_ALL(help="Delete every dead letter.")
def dlq_purge(ids: tuple[str, ...], everything: bool, **options: Any) -> None:
    """Delete the dead letters IDS, or --all."""
    if not ids and not everything:
        raise click.UsageError("name dead-letter IDS or pass --all")
    r, keys = _dlq_target(options)
    click.echo(f"deleted {dead_letters.purge(r, keys, list(ids))}")
