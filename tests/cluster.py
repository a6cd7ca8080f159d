"""A real local Redis Cluster for the tests: 3 masters and 3 replicas on free loopback ports.

Each node is a :class:`RedisServer` (its own temporary directory, no persistence) started
with ``--cluster-enabled yes``; ``redis-cli --cluster create`` joins them, and the cluster
is ready once every node says ``cluster_state:ok`` and every master has its replica.

The session shares one (conftest.py, ``cluster``), made whole again before each test that
uses it (:meth:`LocalCluster.restore`). Replication is tuned for a quick start: no delay
before a full sync, and a master pings its replicas every second (the default, 10 s, keeps
a fresh replica's offset at 0, and so out of CLUSTER SLOTS, for up to 10 s).
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from types import TracebackType

import redis
from redbatch.cli.redis_server import PortTaken, RedisServer, RedisServerError

#: Client ports, and their cluster bus ports (+10000), stay below the kernel's ephemeral range
#: (32768 up): a port picked there can be handed to some test's outgoing connection between
#: the check and redis-server's bind (a CI run failed so).
_PORT_RANGE = (10_000, 22_000)
#: Tries for a node whose port is taken by the time it binds: each gets a new port pair.
_NODE_ATTEMPTS = 5


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: set[int]) -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(1000):
        port = random.randint(*_PORT_RANGE)
        if port not in taken and _bindable(port) and _bindable(port + 10_000):
            return port
    raise RedisServerError("no free port pair for a cluster node")


class LocalCluster:
    """``masters`` masters with ``replicas`` replica each; a context manager that always
    kills every node and removes their directories."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1500,
                 extra_args: list[str] | None = None) -> None:
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        #: More redis-server options for every node (``--cluster-require-full-coverage no``).
        self.extra_args = extra_args or []
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node_url(self, node: RedisServer) -> str:
        return f"redis://127.0.0.1:{node.port}/0"

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        self.start_nodes()
        create = subprocess.run(
            ["redis-cli", "--cluster", "create",
             *[f"127.0.0.1:{n.port}" for n in self.nodes],
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, timeout=timeout_s, check=False)
        if create.returncode != 0:
            raise RedisServerError("redis-cli --cluster create failed: "
                                   + create.stdout.decode(errors="replace")[-2000:])
        self.wait_ok(timeout_s)
        return self

    def start_nodes(self) -> None:
        """Every node, each on its own: no cluster yet (``redis-cli --cluster create``)."""
        taken: set[int] = set()
        for _ in range(self.masters * (1 + self.replicas)):
            self.nodes.append(self._start_node(taken))

    def _start_node(self, taken: set[int]) -> RedisServer:
        """One node on a free port pair; another pair when the port is taken meanwhile."""
        for attempt in range(_NODE_ATTEMPTS):
            port = free_cluster_port(taken)
            taken.add(port)
            node = RedisServer(port=port, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1",
                *self.extra_args])
            try:
                return node.start()
            except PortTaken:
                node.stop()
                if attempt == _NODE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def wait_ok(self, timeout_s: float, nodes: list[RedisServer] | None = None) -> None:
        """Until every (live) node says cluster_state:ok and sees every master with its
        replicas attached; RedisServerError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        nodes = nodes if nodes is not None else self.nodes
        last = ""
        while time.monotonic() < deadline:
            last = self._not_ready(nodes)
            if not last:
                return
            time.sleep(0.1)
        raise RedisServerError(f"cluster not ready after {timeout_s}s: {last}")

    def _not_ready(self, nodes: list[RedisServer]) -> str:
        """Why the cluster is not ready yet; empty once it is."""
        for node in nodes:
            r = redis.Redis.from_url(self.node_url(node), socket_timeout=1)
            try:
                info = r.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return f"node {node.port}: not ok"
                masters = [line for line in r.execute_command("CLUSTER", "NODES").decode()
                           .splitlines() if "master" in line and "fail" not in line]
                if len(masters) != self.masters:
                    return f"node {node.port} sees {len(masters)} masters"
                for line in masters:
                    node_id = line.split()[0]
                    if len(r.execute_command("CLUSTER", "REPLICAS", node_id)) < self.replicas:
                        return f"master {node_id} has no replica yet"
                # CLUSTER SLOTS lists a replica (to clients) once it has synced.
                for _, _, *serving in r.execute_command("CLUSTER", "SLOTS"):
                    if len(serving) < 1 + self.replicas:
                        return f"node {node.port}: a replica has not synced yet"
            except redis.RedisError as e:
                return f"node {node.port}: {e}"
            finally:
                r.close()
        return ""

    def master_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        r = redis.Redis.from_url(self.node_url(self.live()[0]), socket_timeout=1)
        try:
            slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            r.close()
        raise RedisServerError(f"no master serves the slot of {key}")

    def restore(self, timeout_s: float = 60.0) -> None:
        """Every node a test killed started again (a master that failed over comes back as
        a replica of its successor), then :meth:`wait_ok`: the cluster as a test expects it."""
        for node in self.nodes:
            if node.pid is None:
                node.start()
        self.wait_ok(timeout_s)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.pid is not None]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def wait_replicated(primary: RedisServer, timeout_s: float = 10.0) -> None:
    """Until every replica of ``primary`` has all it wrote (offsets equal): writes acknowledged
    before this survive the primary's death."""
    r = redis.Redis(port=primary.port, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            info = r.info("replication")
            replicas = [v for k, v in info.items() if k.startswith("slave")]
            if replicas and all(int(v["offset"]) >= int(info["master_repl_offset"])
                                for v in replicas):
                return
            time.sleep(0.05)
    finally:
        r.close()
    raise RedisServerError(f"replicas of {primary.port} did not catch up in {timeout_s}s")
