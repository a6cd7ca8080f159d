"""Who is calling: bearer API keys mapped to tenants, read from a TOML file.

    [tenants.acme]
    key_sha256 = "<hex SHA-256 of the API key>"   # or key = "..." (the key itself)
    redis_url_env = "ACME_REDIS_URL"   # or redis_url = "...": its ACL user's URL
    max_jobs = 100                     # its bound on jobs in flight (default: none)
    models = ["all_minilm_l6_v2"]      # the models it may use (default: every one)

A tenant without a Redis URL uses the gateway's own (``--redis``). Keys are compared by
their SHA-256, so the file need not hold them. With no file there is one tenant,
``anonymous``, and no key is asked for.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redbatch.common.config import check_redis_url
from redbatch.common.protocol import validate_name
from redbatch.common.protocol.tenants import tenant_name

ANONYMOUS = "anonymous"
"""The one tenant of a gateway started without a tenants file."""
_FIELDS = {"key", "key_sha256", "redis_url", "redis_url_env", "max_jobs", "models"}


class TenantsError(ValueError):
    """The tenants file is unreadable or wrong: one line saying where."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: its name (its request ids begin with ``name:``), the SHA-256 of its key,
    the Redis URL it submits with (None: the gateway's), its bound and its models."""

    name: str
    key_sha256: str = ""
    redis_url: str | None = None
    max_jobs: int | None = None
    models: tuple[str, ...] = ()

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models


class Tenants:
    """The tenants, looked up by the SHA-256 of the bearer key."""

    def __init__(self, tenants: list[Tenant], open_: bool = False) -> None:
        self.all = tenants
        self.open = open_
        self._by_hash = {t.key_sha256: t for t in tenants}

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, or None."""
        if self.open:
            return self.all[0]
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        found = self._by_hash.get(digest)
        # The dict found it by the digest; compare once more in constant time.
        if found is None or not hmac.compare_digest(found.key_sha256, digest):
            return None
        return found


def open_tenants() -> Tenants:
    """A gateway without a tenants file: one anonymous tenant, no key."""
    return Tenants([Tenant(ANONYMOUS)], open_=True)


def load_tenants(path: Path, env: Mapping[str, str] | None = None) -> Tenants:
    """The tenants of the TOML file ``path``; TenantsError naming what is wrong."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise TenantsError(f"tenants file {path}: {e}") from e
    table = data.get("tenants")
    if not isinstance(table, dict) or not table:
        raise TenantsError(f"tenants file {path}: no [tenants.NAME] table")
    tenants = [_tenant(name, fields, os.environ if env is None else env, path)
               for name, fields in table.items()]
    hashes = [t.key_sha256 for t in tenants]
    if len(set(hashes)) != len(hashes):
        raise TenantsError(f"tenants file {path}: two tenants have the same key")
    return Tenants(tenants)


def _tenant(name: str, fields: Any, env: Mapping[str, str], path: Path) -> Tenant:
    where = f"tenants file {path}, tenant {name!r:.40}"
    try:
        if not isinstance(fields, dict):
            raise ValueError("is not a table")
        tenant_name(name)
        unknown = set(fields) - _FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        return Tenant(name, _key_hash(fields), _redis_url(fields, env), _bound(fields),
                      tuple(validate_name(m) for m in _strings(fields.get("models", []))))
    except ValueError as e:
        raise TenantsError(f"{where}: {e}") from None


def _key_hash(fields: Mapping[str, Any]) -> str:
    if "key" in fields and isinstance(fields["key"], str) and fields["key"]:
        return hashlib.sha256(fields["key"].encode()).hexdigest()
    digest = fields.get("key_sha256")
    if not (isinstance(digest, str) and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest.lower())):
        raise ValueError("needs key_sha256 (64 hex digits) or key")
    return digest.lower()


def _redis_url(fields: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    url = fields.get("redis_url")
    variable = fields.get("redis_url_env")
    if variable is not None:
        if not isinstance(variable, str) or variable not in env:
            raise ValueError(f"redis_url_env names {variable!r:.60}, which is not set")
        url = env[variable]
    if url is None:
        return None
    if not isinstance(url, str):
        raise ValueError("redis_url must be a string")
    return check_redis_url(url)


def _bound(fields: Mapping[str, Any]) -> int | None:
    bound = fields.get("max_jobs")
    if bound is None:
        return None
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        raise ValueError("max_jobs must be a whole number, 0 or more")
    return bound


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("models must be a list of model names")
    return value
