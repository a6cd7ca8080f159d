"""The protocol's Redis function library (PROTOCOL.md "The function library"): admission,
status and cancel as Redis 7 functions, called with FCALL / FCALL_RO.

NOTE [ Functions, not scripts ]
  A user allowed EVAL may run any Lua, ``while true do end`` included, which holds every
  client of that Redis at ``BUSY`` until an admin's ``SCRIPT KILL``. Functions are loaded
  once (``FUNCTION LOAD``, by a worker at start or ``redbatch acl --apply``), and a producer
  is granted FCALL and FCALL_RO only: it can run these three functions and no Lua of its
  own. Redis checks the commands a function calls against the caller's ACL, so a producer
  still needs (and has) the commands the functions run on its models' keys (XADD and XDEL
  of the lanes, SET of owner keys); see PROTOCOL.md "Trust model".

  Versions: the library's name carries its version (``redbatch_v2``) and so does each
  function's (``redbatch_v2_admit``). A new version is a new library loaded beside the old
  one, so a client calling the old names keeps working while anything still loads them;
  ``FUNCTION LOAD REPLACE`` of the same version is idempotent.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redbatch.common.protocol.admission import ADMIT_SCRIPT
from redbatch.common.protocol.lifecycle import CANCEL_SCRIPT, STATUS_SCRIPT

LIBRARY_VERSION = 2
"""Version of the function library; a change of any function's behaviour raises it."""
LIBRARY_NAME = f"redbatch_v{LIBRARY_VERSION}"
ADMIT_FUNCTION = f"{LIBRARY_NAME}_admit"
"""FCALL ADMIT_FUNCTION: keys and arguments of the admission script (ADMIT_SCRIPT)."""
STATUS_FUNCTION = f"{LIBRARY_NAME}_status"
"""FCALL_RO STATUS_FUNCTION (flag ``no-writes``): keys of the status script (STATUS_SCRIPT)."""
CANCEL_FUNCTION = f"{LIBRARY_NAME}_cancel"
"""FCALL CANCEL_FUNCTION: keys and arguments of the cancel script (CANCEL_SCRIPT)."""
FUNCTIONS = (ADMIT_FUNCTION, STATUS_FUNCTION, CANCEL_FUNCTION)

#: Redis's reply to FCALL of a function no library holds (redis-py strips ``ERR``).
MISSING_REPLY = "Function not found"


def _wrapped(name: str, body: str) -> str:
    """A script body as a local Lua function of KEYS and ARGV, as EVAL would give them."""
    return f"local function {name}(KEYS, ARGV)\n{body}end\n"


LIBRARY = (
    f"#!lua name={LIBRARY_NAME}\n"
    f"-- redbatch function library, protocol 1 (version {LIBRARY_VERSION})\n"
    + _wrapped("admit", ADMIT_SCRIPT)
    + _wrapped("status", STATUS_SCRIPT)
    + _wrapped("cancel", CANCEL_SCRIPT)
    + f"redis.register_function('{ADMIT_FUNCTION}', admit)\n"
    f"redis.register_function{{function_name = '{STATUS_FUNCTION}', callback = status,\n"
    "                         flags = {'no-writes'}}\n"
    f"redis.register_function('{CANCEL_FUNCTION}', cancel)\n"
)
"""The library's text, as ``FUNCTION LOAD REPLACE`` takes it; PROTOCOL.md holds it verbatim.
Each function's body is its script's text, run on the keys and arguments FCALL gives it."""


def is_missing(error: BaseException) -> bool:
    """Whether ``error`` is Redis saying the function called is not loaded (it ran nothing)."""
    return isinstance(error, redis.ResponseError) and str(error).startswith(
        (MISSING_REPLY, f"ERR {MISSING_REPLY}"))


def load_library(r: redis.Redis | Any) -> None:
    """Load (or replace with the same text) the library; on a cluster, on every master.
    Raises redis-py's errors: NoPermissionError for a user without FUNCTION LOAD."""
    r.function_load(LIBRARY, replace=True)


async def load_library_async(r: aioredis.Redis | Any) -> None:
    """:func:`load_library`, awaited."""
    await r.function_load(LIBRARY, replace=True)
