"""``redbatch submit``: send files to a model, and print one JSON line per file."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from redbatch.cli import options as o
from redbatch.cli.errors import BadInput
from redbatch.cli.redis_target import redis_for
from redbatch.cli.signals import signals_raise
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import Lane
from redbatch.scoring.files import submit_files
from redbatch.scoring.inputs import iter_files


@click.command()
@o.private_stack_options
@click.argument("files", nargs=-1, required=True, type=click.Path())
@o.opt("--wait/--no-wait", env="WAIT", default=False,
       help="Wait for and print each result (always on with a private stack).")
@o.TIMEOUT_S(default=60.0, help="Deadline of each job and how long to wait for it, seconds.")
@o.LANE(default=Lane.INTERACTIVE.value)
def submit(files: tuple[str, ...], wait: bool, timeout_s: float, lane: str,
           **options: Any) -> None:
    """Submit FILES (or folders of images); print one JSON line per file.

    Each file is sent as it is, with a content type from its suffix (a .txt as text, a
    .json as JSON, a .npy as an array): the model decides what it accepts. Lists of files
    (manifests) are for redbatch score."""
    setup_logging(options["log_level"])
    paths = list(iter_files(files))
    # Checked before anything starts: a private stack takes seconds to say "nothing".
    if not paths:
        raise BadInput(f"nothing to submit: no image in {', '.join(files)}")
    if not any(path.is_file() and os.access(path, os.R_OK) for path in paths):
        raise BadInput(f"cannot read any of the files: {', '.join(map(str, paths))}"
                               [:300])
    # The private stack goes away when we return, so its results are always awaited.
    wait = wait or not options["redis_url"]
    with signals_raise(), redis_for(options) as url:
        ok = submit_files(url, paths, model=o.served_name(options), prefix=options["prefix"],
                          wait=wait, timeout_s=timeout_s, lane=lane)
    sys.exit(0 if ok else 1)
