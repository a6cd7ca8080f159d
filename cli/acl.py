"""``redbatch acl``: least-privilege Redis users for producers and workers.

The rules themselves (which commands and keys each role may touch) are
``acl_rules.py``'s; this module parses the options, picks or generates the
passwords, and prints the users or creates them on an admin connection.
"""

from __future__ import annotations

import secrets

import click
import redis
from redbatch.cli import acl_rules as rules
from redbatch.cli import options as o
from redbatch.cli.redis_target import connect_to
from redbatch.common.config import redact_url
from redbatch.common.protocol import Keys

ACL_PASSWORD_HINT = ("--apply shows no password: give --producer-password and "
                     "--worker-password (or REDBATCH_ACL_PRODUCER_PASSWORD and "
                     "REDBATCH_ACL_WORKER_PASSWORD; --tenant-password for a tenant)")
ROLES = tuple(role.value for role in rules.Role)
#: The roles made when no --role is given; a tenant's user only when asked for.
DEFAULT_ROLES = (rules.Role.PRODUCER.value, rules.Role.WORKER.value)


@click.command()
# Served names (repeatable, required), not a model to load as --model is elsewhere.
@click.option("--model", "models", multiple=True, required=True,
              help="Served model name the users are for (repeatable).")
@o.PREFIX()
@click.option("--role", "roles", multiple=True, type=click.Choice(ROLES),
              help="Which users to make (repeatable) [default: producer and worker]; "
                   "tenant: a gateway's producer for --tenant (docs/gateway.md).")
@o.opt("--tenant", env="ACL_TENANT", default=None,
       help="The gateway tenant of --role tenant: its request ids begin with NAME:.")
@o.opt("--tenant-user", env="ACL_TENANT_USER", default=None,
       help="User name of the tenant's producer [default: redbatch-tenant-NAME].")
@o.opt("--tenant-password", env="ACL_TENANT_PASSWORD", default=None,
       help="The tenant user's password; default: a random one, shown once.")
@o.opt("--producer-user", env="ACL_PRODUCER_USER", default="redbatch-producer",
       help="User name of the producer.")
@o.opt("--worker-user", env="ACL_WORKER_USER", default="redbatch-worker",
       help="User name of the worker.")
@o.opt("--producer-password", env="ACL_PRODUCER_PASSWORD", default=None,
       help="The producer's password (prefer the variable: options show in ps); "
            "default: a random one, shown once.")
@o.opt("--worker-password", env="ACL_WORKER_PASSWORD", default=None,
       help="The worker's password; default: a random one, shown once.")
@click.option("--format", "fmt", type=click.Choice(["setuser", "aclfile"]), default="setuser",
              show_default=True,
              help="ACL SETUSER commands (pipe them into redis-cli) or ACL file lines.")
@click.option("--apply", "apply_", is_flag=True, default=False,
              help="Create the users on --redis (an admin connection) instead of printing.")
@o.REDIS(help="Admin URL of the Redis the users are for: needed by --apply; without it the "
              "rules are for Redis 7.2 or later, and the printed URLs name localhost.")
def acl(models: tuple[str, ...], prefix: str, roles: tuple[str, ...], fmt: str, apply_: bool,
        redis_url: str | None, tenant: str | None, **names: str | None) -> None:
    """Print (or --apply) least-privilege Redis ACL users for producers and workers.

    A producer may submit jobs, read, await and delete results, read token streams and
    set stop keys of the --model(s) and nothing else: no writing results, done tokens or
    token streams, no other model, no admin command.
    A worker may do what a worker does, for those models only. The rules keep only each
    password's SHA-256 (#<hash>), so they can be stored. The URL to connect with goes to
    stderr, with the password only when it was generated here. Needs Redis 7.0 or later.
    """
    if apply_ and not redis_url:
        raise click.UsageError("--apply needs --redis: an admin user's URL")
    wanted = [rules.Role(role) for role in dict.fromkeys(roles or DEFAULT_ROLES)]
    if rules.Role.TENANT in wanted and not tenant:
        raise click.UsageError("--role tenant needs --tenant NAME")
    names["tenant_user"] = names["tenant_user"] or f"redbatch-tenant-{tenant}"
    given = {role: names[f"{role.value}_password"] for role in wanted}
    if apply_ and None in given.values():
        raise click.UsageError(ACL_PASSWORD_HINT)
    passwords = {role: given[role] or secrets.token_urlsafe(24) for role in wanted}
    admin = _acl_admin(redis_url)
    try:
        version = rules.server_version(admin) if admin else rules.SETINFO_SINCE
        keys = [Keys(model, prefix) for model in dict.fromkeys(models)]
        users = [rules.build_user(str(names[f"{role.value}_user"]), role, passwords[role],
                                  keys, version, tenant) for role in wanted]
        if admin is not None and apply_:
            rules.load_functions(admin)
        for user in users:
            if admin is not None and apply_:
                rules.apply(admin, user)
            else:
                click.echo(user.setuser_line() if fmt == "setuser" else user.aclfile_line())
            shown = None if given[user.role] else passwords[user.role]
            click.echo(_acl_note(user, models, rules.user_url(redis_url, user.name, shown),
                                 apply_), err=not apply_)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    except redis.exceptions.NoPermissionError as e:
        raise click.ClickException(f"NOPERM: {e}; --redis must be an admin user's URL "
                                   f"(it is {redact_url(str(redis_url))})") from e
    except redis.RedisError as e:
        raise click.ClickException(f"Redis at {redact_url(str(redis_url))} refused: {e}") from e


def _acl_admin(url: str | None) -> redis.Redis | None:
    """An admin connection to ``url`` (None without one); one line when it fails."""
    if url is None:
        return None
    r = connect_to(url)
    try:
        r.ping()
    except redis.RedisError as e:
        raise click.ClickException(f"cannot reach Redis at {redact_url(url)}: {e}") from e
    return r


def _acl_note(user: rules.AclUser, models: tuple[str, ...], url: str, applied: bool) -> str:
    """The line saying which user was made and the URL to connect with."""
    what = f"ACL user {user.name} ({user.role.value} of {', '.join(models)})"
    hint = "" if ":***@" not in url else " (*** is the password you gave)"
    if applied:
        return f"applied {what}: connect with {url}{hint}"
    return f"# {what}: connect with {url}{hint or ' (a generated password, shown once)'}"
