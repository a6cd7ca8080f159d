"""``redbatch score``: score many inputs into one output file, resumably.

The scoring is ``scoring/bulk.py``'s :class:`BulkScorer`; this module parses the
options, finds the Redis (or starts a private stack), and turns what can go wrong
into one line and an exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import redis
from redbatch.cli import options as o
from redbatch.cli.errors import BadInput
from redbatch.cli.redis_target import redis_for
from redbatch.cli.signals import signals_raise, signals_stop
from redbatch.common.config import default_of
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import Lane
from redbatch.common.redis_io import RedisRefused, RedisUnavailable
from redbatch.producer.client import Client
from redbatch.scoring.bulk import BulkScorer, ScoreSettings
from redbatch.scoring.inputs import ManifestError, count_items, iter_items
from redbatch.scoring.output import DoneIndex, OutputWriter
from redbatch.scoring.progress import Progress, verdict
from redbatch.scoring.watch import WorkerWatch

logger = logging.getLogger(__name__)


@click.command()
@o.private_stack_options
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Output file: one record per input.")
@o.opt("--format", "fmt", env="FORMAT", type=click.Choice(["jsonl", "csv"]), default=None,
       help="Output format; default: from the output's suffix (.csv), else jsonl.")
@o.opt("--resume", env="RESUME", is_flag=True, default=False,
       help="Skip inputs already in the output file and append the rest.")
@o.opt("--overwrite", env="OVERWRITE", is_flag=True, default=False,
       help="Replace an existing output file.")
@o.opt("--window", env="WINDOW", type=click.IntRange(min=1),
       default=default_of(ScoreSettings, "window"), help="Jobs in flight at most.")
@o.TIMEOUT_S(default=default_of(ScoreSettings, "timeout_s"),
             help="Deadline of each job, seconds; late ones are written as 'timeout'.")
@o.opt("--grace-s", env="GRACE_S", type=click.FloatRange(min=0),
       default=default_of(ScoreSettings, "grace_s"),
       help="After Ctrl-C/SIGTERM, how long jobs in flight are still collected.")
@o.LANE(default=default_of(ScoreSettings, "lane").value)
@o.opt("--texts", env="TEXTS", is_flag=True, default=False,
       help="Each line of a .txt input is a text to score (a text model such as "
            "all_minilm_l6_v2), not the path of a file. A .jsonl row with 'text' is one "
            "anyway.")
@o.opt("--redis-wait-s", env="REDIS_WAIT_S", type=click.FloatRange(min=0),
       default=default_of(ScoreSettings, "redis_wait_s"),
       help="How long Redis may stay out of reach before the inputs left are written as "
            "'redis_unavailable' errors, seconds.")
@o.opt("--max-error-rate", env="MAX_ERROR_RATE", type=click.FloatRange(0, 1),
       default=default_of(ScoreSettings, "max_error_rate"),
       help="The share of inputs (0-1) that may fail with the run still a success (exit 0).")
@o.opt("--tune", env="TUNE", is_flag=True, default=False,
       help="Without --redis: calibrate the private worker for this machine first when no "
            "profile exists (minutes, once), and store the profile every later run loads.")
def score(inputs: tuple[str, ...], output: str, fmt: str | None, resume: bool,
          overwrite: bool, window: int, timeout_s: float, grace_s: float, lane: str,
          texts: bool, redis_wait_s: float, max_error_rate: float, **options: Any) -> None:
    """Score INPUTS (images, folders, .txt or .jsonl manifests, or texts) into an output
    file.

    Every input gets a record; per-input failures are error records. The exit code is
    0 when at most --max-error-rate of the inputs failed, 1 when more did or an input has
    no record, 130 when interrupted (rerun with --resume); the last line says which.
    """
    started = time.monotonic()
    setup_logging(options["log_level"])
    fmt = fmt or ("csv" if output.lower().endswith(".csv") else "jsonl")
    if Path(output).exists() and not (resume or overwrite):
        raise click.ClickException(f"{output} exists: use --resume to finish it or "
                                   "--overwrite to replace it")
    check_output_folder(output)
    try:  # checked before anything starts
        first = next(iter(iter_items(inputs, texts)), None)
    except ManifestError as e:  # a malformed first line: one line, as any other
        raise click.ClickException(str(e)) from None
    if first is None:
        raise BadInput(f"nothing to score: no {'text' if texts else 'image'} in "
                       f"{', '.join(inputs)}")
    settings = ScoreSettings(window=window, lane=Lane(lane), timeout_s=timeout_s,
                             grace_s=grace_s, redis_wait_s=redis_wait_s,
                             max_error_rate=max_error_rate)
    existed = Path(output).exists()
    try:
        code, line = _score(inputs, texts, output, fmt, resume, settings, options, started)
    except ManifestError as e:
        _remove_if_empty(output, fmt, existed)
        raise click.ClickException(str(e)) from e
    except (redis.ConnectionError, redis.TimeoutError, RedisUnavailable) as e:
        raise click.ClickException(f"lost the connection to Redis: {e}; the output holds "
                                   "what was finished, rerun with --resume") from e
    except (redis.ResponseError, RedisRefused) as e:  # NOPERM, OOM...: said by Redis, one line
        raise click.ClickException(f"Redis refused: {e}; the output holds what was "
                                   "finished, rerun with --resume") from e
    click.echo(line, err=True)
    sys.exit(code)


def check_output_folder(output: str) -> None:
    """BadInput (exit code 2) unless the output's folder exists and is writable:
    checked before a private stack starts, not after."""
    folder = Path(output).absolute().parent
    if not folder.is_dir():
        raise BadInput(f"the folder of -o {output} does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise BadInput(f"cannot write into the folder of -o {output}: {folder}")


def _remove_if_empty(output: str, fmt: str, existed: bool) -> None:
    """A run that failed before writing any record leaves no output file behind."""
    path = Path(output)
    if existed or not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    if lines == 0 or (fmt == "csv" and lines == 1):  # nothing, or the CSV header alone
        path.unlink()


def _score(inputs: tuple[str, ...], texts: bool, output: str, fmt: str, resume: bool,
           settings: ScoreSettings, options: dict[str, Any], started: float) -> tuple[int, str]:
    """Run the scorer to the end or to a stop signal; the exit code and the line that says
    why (``progress.verdict``). ``started``: when the command began (monotonic), for the
    summary's start-up time."""
    done = DoneIndex.from_output(output, fmt) if resume else DoneIndex.empty()
    name = o.served_name(options)
    with signals_raise(), redis_for(options) as url, \
            Client(url, model=name, prefix=options["prefix"]) as client:
        writer = OutputWriter(output, fmt, append=resume)
        scorer = BulkScorer(client, writer, settings, done)
        scorer.stats.startup_s = time.monotonic() - started
        scorer.progress = progress = Progress(scorer.stats)
        # Counting a large tree or manifest takes a while; the run need not wait for it.
        threading.Thread(target=lambda: setattr(progress, "total", count_items(inputs, texts)),
                         name="count-inputs", daemon=True).start()
        try:
            with signals_stop(scorer.stop, scorer.stop), WorkerWatch(client, name):
                complete = scorer.run(iter_items(inputs, texts))
        finally:
            writer.close()
            click.echo(scorer.stats.summary(), err=True)
    return verdict(scorer.stats, complete, scorer.stopping.is_set(), settings.max_error_rate)
