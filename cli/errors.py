"""How the CLI says an ordinary mistake: one line on stderr (``Error: ...``, as click says
a bad option) and an exit code, never a traceback. The group in ``__init__.py`` turns the
ordinary exceptions of any command into these (:func:`ordinary`); commands raise BadInput
for inputs they check before starting anything."""

from __future__ import annotations

import click

#: What a worker imports beyond the client's own dependencies (pyproject's ``worker``
#: extra, by import name), and how to get them.
WORKER_MODULES = ("torch", "numpy", "PIL", "prometheus_client")
WORKER_EXTRA = "pip install 'redbatch[worker]'"
#: Said after "cannot reach Redis": how to name another one.
REDIS_HINT = "(give its URL with --redis URL or REDBATCH_REDIS_URL)"


class OrdinaryError(click.ClickException):
    """A mistake or a state of the world the user can fix, said in one line (``Error: ...``
    on stderr, as click says a bad option), never a traceback; exit code 1."""


class Interrupted(OrdinaryError):
    """Ctrl-C (SIGINT) while a command ran: exit code 130, as a shell reports it."""

    exit_code = 130


def ordinary(e: BaseException) -> OrdinaryError | None:
    """The one-line form of ``e`` when it is ordinary; None for a bug (its traceback is the
    report). Redis's connection messages name host and port, never the password."""
    import redis
    from redbatch.common.protocol import RedbatchError
    from redbatch.common.redis_io import RedisRefused, RedisUnavailable

    if isinstance(e, KeyboardInterrupt):
        return Interrupted("interrupted")
    if isinstance(e, redis.AuthenticationError):
        return OrdinaryError(f"Redis refused the login: {e}")
    if isinstance(e, redis.ConnectionError | redis.TimeoutError | RedisUnavailable):
        return OrdinaryError(f"cannot reach Redis: {e} {REDIS_HINT}")
    if isinstance(e, RedisRefused):
        return OrdinaryError(f"Redis refused: {e}")
    if isinstance(e, redis.exceptions.NoPermissionError):
        return OrdinaryError(f"Redis refused a command (check the user's ACL): {e}")
    if isinstance(e, RedbatchError):
        return OrdinaryError(str(e))
    if isinstance(e, ModuleNotFoundError) and e.name is not None and \
            e.name.split(".")[0] in WORKER_MODULES:
        return OrdinaryError(f"this command needs the worker's dependencies: {WORKER_EXTRA} "
                             f"(missing: {e.name})")
    if isinstance(e, OSError) and e.filename is not None:
        return OrdinaryError(f"{e.strerror or e}: {e.filename}")
    return None


class BadInput(OrdinaryError):
    """Inputs or options that cannot work (nothing to score, an output folder that does not
    exist): exit code 2, like click's usage errors, without the usage lines."""

    exit_code = 2
