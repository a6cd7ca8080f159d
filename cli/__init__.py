"""The ``redbatch`` command, the top floor: it imports every other package, none imports it.

Each command group has a module here; the private-stack supervisors (a redis-server and a
local worker for commands run without ``--redis``), the fleet status reader and view, and
the ACL rules live beside the commands that use them.
"""

from redbatch.cli.commands import main

__all__ = ["main"]
