"""The ``redbatch`` command, the top floor: it imports every other package, none imports it.

One module per command group, each importing downward only:

    options.py        options several commands take, each defined once; defaults read
                      from common/config.py
    signals.py        SIGINT/SIGTERM while a command runs
    redis_target.py   the Redis a command talks to: --redis, or a private stack
    worker.py         worker: serve a model (builds the one Settings object)
    calibrate.py      calibrate: measure the model on the device, store its profile
    submit.py         submit: send files, print one JSON line each
    score.py          score: many inputs into one output file, resumably
    queues.py         limit, job, dlq: bound a lane's queue; show or cancel one job;
                      list, replay, purge dead letters
    fleet.py          status, top: a running fleet, once or live
    acl.py            acl: least-privilege Redis users
    sweep.py          sweep: mend the owner and stop keys a producer may have planted
    gateway.py        gateway: the HTTP gateway (the gateway/ package) under uvicorn
    errors.py         how an ordinary mistake is said: one line and an exit code

Beside them live what the commands use: the private-stack supervisors
(``local_stack.py``, ``redis_server.py``), the fleet status reader and view
(``fleet_state.py``, ``fleet_view.py``) and the ACL rules (``acl_rules.py``).
"""

import click
from redbatch import __version__
from redbatch.cli import (
    acl,
    calibrate,
    fleet,
    gateway,
    generate,
    queues,
    score,
    submit,
    sweep,
    worker,
)
from redbatch.cli.errors import ordinary

HELP = """redbatch: dynamic-batching PyTorch inference over Redis streams.

\b
Start a worker for the default model (EfficientNet-Lite0, ImageNet):
  redbatch worker --redis redis://localhost:6379/0
Classify photos and print one JSON line per file:
  redbatch submit --wait --redis redis://localhost:6379/0 cat.jpg photos/
Without --redis (and no REDBATCH_REDIS_URL), submit starts a private
redis-server and a local worker, and stops both when done.
Where one job is, or cancel it while it is queued:
  redbatch job --redis redis://localhost:6379/0 REQUEST_ID [--cancel]
Watch queues, workers and latency (once, or live):
  redbatch status --redis redis://localhost:6379/0
  redbatch top --redis redis://localhost:6379/0
"""


class _Main(click.Group):
    """The group, turning ordinary errors of any command into one line (see ``ordinary``)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (Exception, KeyboardInterrupt) as e:
            one_line = ordinary(e)
            if one_line is None:
                raise
            raise one_line from None


@click.group(cls=_Main, help=HELP)
@click.version_option(__version__, prog_name="redbatch")
def main() -> None:
    """The ``redbatch`` group; its commands are added below."""


for _command in (worker.worker, calibrate.calibrate, submit.submit, score.score, queues.limit,
                 queues.partitions, queues.job, queues.dlq, fleet.status, fleet.top, acl.acl,
                 gateway.gateway, generate.generate, sweep.sweep_command):
    main.add_command(_command)

__all__ = ["main"]
