"""``redbatch limit``, ``job`` and ``dlq``: a model's queues, bounded, looked into and
dead-lettered.

``limit`` bounds a lane's queue (admission control) and ``job`` shows or cancels one job,
both through the producer's :class:`Client`; ``dlq`` lists, replays and deletes dead
letters through ``cli/dead_letters.py``; ``partitions`` shows or raises the partition count.
All act on one model's keys, in every partition of it (PROTOCOL.md "Partitions").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar, cast

import click
import redis
from redbatch.cli import dead_letters
from redbatch.cli import options as o
from redbatch.cli.errors import BadInput
from redbatch.cli.redis_target import connect_to
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import (
    DEFAULT_PARTITIONS_SCRIPT,
    RAISE_PARTITIONS_SCRIPT,
    JobStatus,
    Keys,
    Lane,
    parse_partition_history,
    valid_request_id,
)
from redbatch.producer.client import Client

T = TypeVar("T")


@click.command()
@o.common_options
@o.LANE(envvar=None, default=None,
        help="The lane to bound or clear (required with --max-jobs, --max-tokens or --clear).")
@click.option("--max-jobs", type=click.IntRange(min=0), default=None,
              help="Most jobs the lane's queue may hold (queued or in progress); a submit "
                   "past it fails with queue_full. 0 refuses every job.")
@click.option("--max-tokens", type=click.IntRange(min=0), default=None,
              help="Most tokens the lane's queued generation jobs may be charged (each: "
                   "its payload's bytes plus its max_new_tokens); a generation job past "
                   "it fails with queue_full at once. 0 refuses every generation job.")
@click.option("--clear", is_flag=True, default=False, help="Remove the lane's bounds.")
def limit(lane: str | None, max_jobs: int | None, max_tokens: int | None, clear: bool,
          **options: Any) -> None:
    """Bound a lane's queue (admission control), clear the bounds, or show both lanes.

    Prints one JSON line per lane: its bounds (null: unbounded), the jobs its queue holds
    and the tokens they are charged. A model of several partitions has the bounds in each
    (set in all of them here): the line then says how many, with the jobs summed and each
    partition's own figures. Without --redis, the worker's default Redis URL is used.
    """
    setup_logging(options["log_level"])
    if (max_jobs is not None or max_tokens is not None) and clear:
        raise click.UsageError("give either --max-jobs/--max-tokens or --clear, not both")
    if (max_jobs is not None or max_tokens is not None or clear) and lane is None:
        raise click.UsageError("--max-jobs, --max-tokens and --clear need --lane")
    name = o.served_name(options)
    # An unreachable Redis is one line: the group's handler (cli/errors.py) says it.
    with Client(o.url_or_default(options), model=name, prefix=options["prefix"]) as client:
        if lane is not None and (max_jobs is not None or clear):
            client.set_queue_limit(lane, max_jobs)
        if lane is not None and (max_tokens is not None or clear):
            client.set_token_limit(lane, max_tokens)
        for state in (client.queue_state(each) for each in Lane):
            shown: dict[str, Any] = {"model": name, "lane": state.lane.value,
                                     "max_jobs": state.bound, "queued": state.queued,
                                     "max_tokens": state.token_bound, "tokens": state.tokens}
            if state.partitions:
                shown["partitions"] = len(state.partitions)
                shown["by_partition"] = [{"max_jobs": bound, "queued": queued}
                                         for queued, bound in state.partitions]
            click.echo(json.dumps(shown))


@click.command()
@o.common_options
@click.option("--set", "count", type=click.IntRange(min=1), default=None,
              help="Raise the model's partition count to this (it can only rise).")
def partitions(count: int | None, **options: Any) -> None:
    """Show the model's partition count and history, or raise it (PROTOCOL.md "Partitions").

    ``--set 1`` on a model with no count records 1: workers on a cluster set a model with
    no count to one partition per master when they first meet it, and leave a recorded 1.

    Lowering is refused: workers would stop reading the partitions past the count, and the
    jobs queued there would never run. Raising copies partition 0's queue bounds to the
    new partitions. Prints one JSON line.
    """
    setup_logging(options["log_level"])
    r = connect_to(o.url_or_default(options), options["prefix"])
    keys = Keys(o.served_name(options), options["prefix"])
    before = parse_partition_history(r.lrange(keys.partitions(), 0, -1))
    if count is not None:
        try:
            r.eval(RAISE_PARTITIONS_SCRIPT, 1, keys.partitions(), count)
            if count == 1:  # recorded: workers on a cluster then leave it at 1
                r.eval(DEFAULT_PARTITIONS_SCRIPT, 1, keys.partitions(), 1)
        except redis.ResponseError as e:
            raise click.ClickException(str(e)) from None
    history = parse_partition_history(r.lrange(keys.partitions(), 0, -1))
    bounds = cast(dict[Any, Any], r.hgetall(keys.limits()))
    if bounds and history[-1] > before[-1]:
        pipe = r.pipeline(transaction=False)
        for p in range(before[-1], history[-1]):
            pipe.hset(keys.part(p).limits(), mapping=bounds)
        pipe.execute()
    click.echo(json.dumps({"model": keys.model, "partitions": history[-1],
                           "history": list(history)}))


@click.command()
@o.common_options
@click.argument("request_id")
@click.option("--cancel", is_flag=True, default=False,
              help="Cancel the job if no worker has taken it yet (it then never runs, and "
                   "its answer is 'cancelled'); exit code 1 when it was too late.")
def job(request_id: str, cancel: bool, **options: Any) -> None:
    """Show where job REQUEST_ID is, or cancel it.

    Prints one JSON line: its state (queued, running, done, failed, cancelled, unknown),
    lane and stream entry, the worker holding it, and its output or error once answered;
    with --cancel, also whether it was cancelled. Read from what Redis holds (PROTOCOL.md
    "Job status"). Without --redis, the worker's default Redis URL is used.
    """
    setup_logging(options["log_level"])
    if not valid_request_id(request_id):
        raise BadInput(f"{request_id[:140]!r} is not a request id (1-128 of A-Z a-z 0-9 _ . : -)")
    name = o.served_name(options)
    with Client(o.url_or_default(options), model=name, prefix=options["prefix"]) as client:
        cancelled = client.cancel(request_id) if cancel else None
        shown = _job_record(client.status(request_id), name)
    if cancelled is not None:
        shown["cancelled"] = cancelled
    click.echo(json.dumps(shown, ensure_ascii=False))
    if cancelled is False:
        raise SystemExit(1)


def _job_record(status: JobStatus, model: str) -> dict[str, Any]:
    """What ``redbatch job`` prints of a status."""
    shown: dict[str, Any] = {"id": status.request_id, "model": model,
                             "state": status.state.value,
                             "lane": status.lane.value if status.lane else None,
                             "entry": status.entry_id, "worker": status.worker,
                             "deliveries": status.deliveries}
    result = status.result
    if result is not None:
        shown["worker"] = result.worker
        if result.ok:
            shown["output"] = result.output
        else:
            code = result.error_code.value if result.error_code else None
            shown["error"] = {"code": code, "message": result.error_message}
    return shown


@click.group()
def dlq() -> None:
    """Look at and replay dead letters (jobs that will not run again), in every partition
    of the model."""


def _dlq_target(options: dict[str, Any]) -> tuple[redis.Redis, Keys]:
    """A client for --redis (the worker's default URL without one) and the model's keys."""
    r = connect_to(o.url_or_default(options), options["prefix"])
    return r, Keys(o.served_name(options), options["prefix"])


#: Every dead letter instead of the IDS named (retry, purge).
_ALL = o.option("--all", "everything", env=None, is_flag=True)
#: One partition's dead letters only (list, retry, purge).
_PARTITION = click.option(
    "--partition", type=click.IntRange(min=0), default=None,
    help="Only this partition's dead letters (as `dlq list` shows them) [default: every "
         "partition's].")


@dlq.command("list")
@o.common_options
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many.")
@_PARTITION
def dlq_list(limit: int | None, partition: int | None, **options: Any) -> None:
    """Print one JSON line per dead letter, oldest first, with its partition; with none,
    say so in one line on stderr (stdout stays JSON lines only)."""
    r, keys = _dlq_target(options)
    found = _or_bad_input(lambda: list(dead_letters.entries(r, keys, limit, partition)))
    for entry in found:
        click.echo(json.dumps(entry))
    if not found:
        where = "" if partition is None else f" in partition {partition}"
        click.echo(f"no dead letters of model {keys.model!r}{where}", err=True)


@dlq.command("retry")
@o.common_options
@click.argument("ids", nargs=-1)
@_ALL(help="Retry every dead letter.")
@_PARTITION
def dlq_retry(ids: tuple[str, ...], everything: bool, partition: int | None,
              **options: Any) -> None:
    """Requeue the dead letters IDS (as `dlq list` shows them), or --all. Each job goes to
    the partition its request id maps to under the model's partition count now."""
    if not ids and not everything:
        raise click.UsageError("name dead-letter IDS or pass --all")
    r, keys = _dlq_target(options)
    try:
        requeued = _or_bad_input(lambda: dead_letters.retry(r, keys, list(ids), partition))
        click.echo(f"requeued {requeued}")
    except dead_letters.RetryQueueFull as e:
        click.echo(f"requeued {e.requeued}")
        raise click.ClickException(str(e)) from e


@dlq.command("purge")
@o.common_options
@click.argument("ids", nargs=-1)
@_ALL(help="Delete every dead letter.")
@_PARTITION
def dlq_purge(ids: tuple[str, ...], everything: bool, partition: int | None,
              **options: Any) -> None:
    """Delete the dead letters IDS, or --all."""
    if not ids and not everything:
        raise click.UsageError("name dead-letter IDS or pass --all")
    r, keys = _dlq_target(options)
    deleted = _or_bad_input(lambda: dead_letters.purge(r, keys, list(ids), partition))
    click.echo(f"deleted {deleted}")


def _or_bad_input(run: Callable[[], T]) -> T:
    """``run()``; a partition the model does not have is one line (BadInput)."""
    try:
        return run()
    except dead_letters.NoSuchPartition as e:
        raise BadInput(str(e)) from None
