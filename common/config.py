"""One typed settings object for a worker, built once from CLI flags and REDBATCH_* variables.

``cli/worker.py`` builds :class:`Settings`; everything else receives it (or
one of its parts) as an argument. Child processes get a copy and make their
own Redis connections from it. The dataclass fields are the one home of every
default: the CLI shows and uses them through :func:`default_of`, never restating
them. The few ``DEFAULT_*`` constants left are those that code outside the
settings (the producer's client, the pool's slot arrays, benches) needs too.

The module runs past 400 lines because it is that one home: every setting of a worker and
its default are declared here, beside the checks of the Redis URL they start from.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import SplitResult, unquote_plus, urlsplit, urlunsplit

from redbatch.common.protocol import DEFAULT_PREFIX, validate_name
from redbatch.common.protocol.generation import MAX_NEW_TOKENS

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_MODEL = "efficientnet_lite0"
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_MAX_INFLIGHT = 64
DEFAULT_MAX_PAYLOAD_BYTES = 20 * 1024 * 1024
#: Padded tokens (rows x the longest) a batch of a text model may hold
#: (gpu_worker/batching/shaping.py).
DEFAULT_MAX_BATCH_TOKENS = 4096
#: Schemes of a Redis URL; the ``+cluster`` ones name a Redis Cluster by its nodes.
REDIS_URL_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_SHM_PREFIX = "redbatch"


@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str = DEFAULT_REDIS_URL
    #: Namespace of every key; two deployments can share one Redis with different prefixes.
    prefix: str = DEFAULT_PREFIX
    #: Socket timeout of non-blocking commands, seconds.
    socket_timeout_s: float = 10.0

    @classmethod
    def from_dsn(cls, url: str, prefix: str = DEFAULT_PREFIX) -> RedisSettings:
        """Settings for ``url``; ValueError (with the URL redacted) for a URL that
        :func:`check_redis_url` refuses or a bad prefix."""
        return cls(url=check_redis_url(url), prefix=validate_name(prefix, "prefix"))

    def __repr__(self) -> str:
        # Never log a password that the URL may carry.
        return f"RedisSettings(url={redact_url(self.url)!r}, prefix={self.prefix!r})"


# A query parameter: its name as written (percent-decoded before it is compared).
_QUERY_PARAM = re.compile(r"[?&;]([^=&;?#]*)=")
_URL_HINT = ("percent-encode the user name and password ('/' as %2F, '?' as %3F, "
             "'#' as %23, '@' as %40, '&' as %26)")


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***``: the one function for anything
    that puts a Redis URL into a log line, an error message or command output.

    Hidden: the userinfo password, taken as everything between the first ':' after
    '://' and the *last* '@' before any query password, so raw '/', '?', '#', ':' and
    '@' in it stay hidden too; and all that follows a ``password=`` (or
    ``ssl_password=``) query parameter. It hides more rather than leak: a URL with no
    ':' in its userinfo hides the whole userinfo, and one whose query password holds a
    raw '@' also hides a host part that could be a userinfo. Never raises.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    query = _query_password(rest)
    head = rest if query is None else rest[:query.start()]
    tail = "" if query is None else rest[query.start():query.end()] + "***"
    at = head.rfind("@")
    # An '@' after a query password may end a userinfo holding '?password=' itself.
    ambiguous = query is not None and "@" in rest[query.end():]
    if at >= 0 and not ambiguous:
        user, colon, _ = head[:at].partition(":")
        head = (f"{user}:***" if colon else "***") + head[at:]
    elif at >= 0 or (ambiguous and ":" in head.split("/", 1)[0]):
        head = "***"
    return f"{scheme}{sep}{head}{tail}"


def _query_password(rest: str) -> re.Match[str] | None:
    """The first query parameter named like a password (``password``, ``ssl_password``,
    also percent-encoded or in capitals): redis-py reads those, and a ``unix://`` URL
    has no other place for one."""
    for m in _QUERY_PARAM.finditer(rest):
        if unquote_plus(m.group(1)).strip().lower().endswith("password"):
            return m
    return None


def check_redis_url(url: str) -> str:
    """``url`` if redis-py reads it as written, else ValueError whose message shows the
    URL redacted (:func:`redact_url`) and says how to fix it.

    Refused: a scheme other than redis, rediss, unix and the cluster ones (a list of
    host:port nodes, database 0 only: :func:`cluster_nodes`); a port that is not a number;
    an '@' outside the userinfo, a fragment, or a query part that is not ``name=value``
    (a password holding a raw '/', '?', '#' or '&' splits the URL early, and redis-py
    would connect elsewhere with a piece of it, or quote that piece in its own error).
    """
    shown = redact_url(url)
    if not url.startswith(tuple(f"{scheme}://" for scheme in REDIS_URL_SCHEMES)):
        raise ValueError(f"unsupported Redis URL scheme in {shown}: use redis://, "
                         "rediss:// (TLS), unix://, or redis+cluster:// (rediss+cluster://) "
                         "for a Redis Cluster")
    if is_cluster_url(url):
        return _check_cluster_url(url, shown)
    try:
        parts = urlsplit(url)
        int(parts.port or 0)  # parsing the port raises ValueError for a non-number
    except ValueError:  # its own text may quote a piece of the password: not kept
        raise ValueError(f"cannot read the Redis URL {shown}: {_URL_HINT}") from None
    if _misread(parts):
        raise ValueError(f"cannot read the Redis URL {shown}: {_URL_HINT}")
    return url


def is_cluster_url(url: str) -> bool:
    """True for a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    return url.startswith(tuple(f"{scheme}://" for scheme in CLUSTER_SCHEMES))


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """Of a cluster URL ``redis+cluster://[user:password@]host:port[,host:port...][/0][?...]``:
    the plain URL of its first node (``redis://`` or ``rediss://``, with the credentials and
    query: what every node is reached with), and every node's (host, port). ValueError for
    a node list that is not host:port pairs (port 6379 when left out)."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    nodes = []
    for node in hostlist.split(","):
        host, colon, port = node.strip().rpartition(":")
        if not colon:
            host, port = port, "6379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not a host:port pair: {node!r}")
        nodes.append((host.strip("[]"), int(port)))
    scheme = parts.scheme.removesuffix("+cluster")
    first = f"{userinfo}{at}{hostlist.split(',')[0].strip()}"
    return urlunsplit((scheme, first, parts.path, parts.query, parts.fragment)), nodes


def _check_cluster_url(url: str, shown: str) -> str:
    """check_redis_url of a cluster URL: its nodes, and the first node's plain URL."""
    try:
        first, _ = cluster_nodes(url)
        parts = urlsplit(first)
    except ValueError:  # its text may quote a piece of the password: not kept
        raise ValueError(f"cannot read the Redis Cluster URL {shown}: list its nodes as "
                         f"host:port,host:port; {_URL_HINT}") from None
    if _misread(parts):
        raise ValueError(f"cannot read the Redis Cluster URL {shown}: {_URL_HINT}")
    dbs = [value for name, _, value in (piece.partition("=") for piece in parts.query.split("&"))
           if name == "db"]
    if parts.path.strip("/") not in ("", "0") or any(db != "0" for db in dbs):
        raise ValueError(f"a Redis Cluster has database 0 only: {shown}")
    return url


def _misread(parts: SplitResult) -> bool:
    """True when a part of the URL is where only a split userinfo or query password puts
    it: an '@' in the path, a fragment, a query part without '=' or with an '@' in its
    name, or an '@' in a value other than a user name, password or ``ssl_*`` file."""
    if "@" in parts.path or parts.fragment:
        return True
    for piece in filter(None, parts.query.split("&")):
        name, eq, value = piece.partition("=")
        name = unquote_plus(name).strip().lower()
        credential = name.endswith(("password", "username")) or name.startswith("ssl_")
        if not eq or "@" in name or ("@" in value and not credential):
            return True
    return False


@dataclass(frozen=True, slots=True)
class BatchSettings:
    #: Largest batch handed to the model.
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    #: How long the oldest waiting request may wait for the batch to fill, ms.
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    #: Jobs read from Redis but not yet answered (bounds memory and shared-memory slots).
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    #: How long the oldest bulk request waits for a fuller batch, ms.
    bulk_max_wait_ms: float = 50.0
    #: Places of a batch owed to bulk requests that went unserved for bulk_starve_ms.
    bulk_share: float = 0.125
    #: How long waiting bulk requests may go unserved before they are owed places, ms.
    bulk_starve_ms: float = 500.0
    #: Expected run time a batch holding bulk requests may reach while interactive traffic
    #: is arriving, ms; 0 for no limit (see gpu_worker/batching/batcher.py LanePolicy).
    bulk_batch_ms: float = 25.0
    #: In-flight places bulk jobs may never take, so interactive jobs are read at once.
    interactive_reserve: int = 0
    #: For a model whose inputs have a cost (the text model: tokens), most padded tokens a
    #: batch may hold (rows x its longest input), and requests are grouped in length
    #: buckets (gpu_worker/batching/shaping.py); 0: plain size batching, padded to the longest.
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_wait_ms < 0:
            raise ValueError("max_wait_ms must be >= 0")
        if self.max_inflight < self.max_batch_size:
            raise ValueError("max_inflight must be >= max_batch_size")
        if self.interactive_reserve == 0:  # default: room for one full interactive batch
            object.__setattr__(self, "interactive_reserve",
                               min(self.max_batch_size, self.max_inflight - 1))
        if not 0 <= self.interactive_reserve < self.max_inflight:
            raise ValueError("interactive_reserve must be below max_inflight")
        if self.max_batch_tokens < 0:
            raise ValueError("max_batch_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    #: Preprocessing processes; 0: auto, the cores the model's threads leave, resolved by
    #: the worker at start (gpu_worker/device/prepare.py choose_pool_processes).
    processes: int = 0
    #: How a pool process is started; spawn never copies the worker's threads or sockets.
    start_method: str = "spawn"
    #: Times a job is retried after the pool process handling it died.
    crash_retries: int = 1
    #: Work queued to one process at a time, in ms of preprocessing as recent records
    #: measured it (preproc_worker/pool.py _Pace): more lets a process go on while the
    #: worker refills it and sends more tasks a message; less keeps an urgent task from
    #: queueing behind bulk work inside a process.
    prefetch_ms: float = 5.0
    #: Start of the worker's /dev/shm names (1-12 of [A-Za-z0-9_]); a worker reclaims the
    #: entries of dead workers with its prefix at start (preproc_worker/shm.py).
    shm_prefix: str = DEFAULT_SHM_PREFIX

    def __post_init__(self) -> None:
        if self.processes < 0:
            raise ValueError("pool processes must be >= 0 (0: auto)")
        if not self.prefetch_ms > 0:
            raise ValueError("pool prefetch must be > 0 ms")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    #: Largest accepted payload, bytes.
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: Largest decoded image, pixels (width x height); bigger is a decompression bomb.
    max_image_pixels: int = 64_000_000
    #: Longest accepted image side, pixels.
    max_image_side: int = 16_384


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """``redbatch gateway`` (docs/gateway.md): the HTTP face of the protocol."""

    #: Address it listens on; loopback unless told otherwise.
    host: str = "127.0.0.1"
    #: Port it listens on.
    port: int = 8000
    #: A request's deadline when it names none (``timeout``), s.
    default_timeout_s: float = 30.0
    #: The deadline of a chat or completions request that names none, s: an answer of
    #: hundreds of tokens takes longer than an embedding.
    generation_timeout_s: float = 120.0
    #: Largest answer a chat or completions request gets when it names no
    #: ``max_tokens`` (the worker's ``--max-new-tokens`` bounds what it may name).
    default_max_tokens: int = 128
    #: How long a gateway that stops waits for the stops and releases still running, s.
    close_wait_s: float = 5.0
    #: The longest deadline a request may ask for, s (a wait the gateway keeps open).
    max_timeout_s: float = 600.0
    #: Largest request body, bytes: a payload and its JSON or multipart framing.
    max_body_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES + 64 * 1024
    #: Most texts in one embeddings request (each job takes up to 16).
    max_texts: int = 2048
    #: How long a model's "a worker is alive" answer is reused, s (one lookup per period).
    ready_cache_s: float = 1.0
    #: Retry-After of a 429 (a lane or a tenant at its bound), s.
    retry_after_s: int = 1
    #: Longest wait of GET /v1/jobs/{id}?wait=S, s.
    max_poll_s: float = 30.0
    #: Longest silence of a streamed answer, s: a stream waits this long at most for its
    #: first chunk before its response starts, and sends an SSE comment (``: keep-alive``)
    #: whenever no chunk came for this long, so that no proxy closes a queued job's stream
    #: (nginx's and most load balancers' idle timeouts are 60 s).
    sse_keepalive_s: float = 15.0
    #: Connections each tenant's client may open to Redis: every wait makes a call or two,
    #: and redis-py's asyncio pool (100 by default) refuses the call past its size at once.
    redis_connections: int = 2000
    #: Admission calls of one tenant in flight at once (gateway/coalesce.py): the requests
    #: that arrive meanwhile go together in the next one, so under load the calls per
    #: request fall instead of the event loop queueing one call each.
    submit_calls_in_flight: int = 2


@dataclass(frozen=True, slots=True)
class ModelSettings:
    #: Built-in model name, a TorchScript file (*.pt) or a factory 'package.module:callable'.
    spec: str = DEFAULT_MODEL
    #: Name under which the model is served (its Redis keys); derived from spec when empty.
    name: str = ""
    #: auto, cpu, cuda or cuda:N.
    device: str = "auto"
    #: Intra-op threads of torch; 0: on CPU each lane's share of the cores, on CUDA the
    #: cores minus pool processes.
    torch_threads: int = 0
    #: CPU: batches run at once, each on its own thread; 0: 2 with 2 cores or more.
    cpu_lanes: int = 0
    #: Run the model and its inputs in channels_last memory format (4-D inputs).
    channels_last: bool = False
    #: Autocast dtype: "" (full precision), "float16" or "bfloat16".
    autocast: str = ""
    #: torch.compile the model (inductor, static shapes: batches round up to compiled sizes).
    compile: bool = False

    def __post_init__(self) -> None:
        validate_name(self.served_name)  # a bad --model-name fails here, not in the worker

    @property
    def served_name(self) -> str:
        return validate_name(self.name or model_name_from_spec(self.spec))


def model_name_from_spec(spec: str) -> str:
    """'pkg.mod:build' -> 'build', '/x/resnet.pt' -> 'resnet', 'efficientnet_lite0' as is."""
    if ":" in spec and not spec.endswith(".pt"):
        base = spec.rsplit(":", 1)[1]
    else:
        base = Path(spec).stem if spec.endswith((".pt", ".pth", ".ts")) else spec
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", base)[:64] or "model"


#: The p95 a batch may take, ms: a number, "auto" (gpu_worker/tuning/latency.py: from
#: each variant's own table), or None (no limit: throughput alone).
Budget = float | Literal["auto"] | None


def parse_latency_budget(text: str) -> Budget:
    """``--latency-budget-ms``: "auto", "off" (or 0: no limit), or milliseconds > 0.
    Raises ValueError otherwise."""
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word in ("off", "none"):
        return None
    try:
        ms = float(word)
    except ValueError:
        raise ValueError(f"latency budget {text!r}: expected auto, off or milliseconds") from None
    if not ms >= 0 or ms == float("inf"):
        raise ValueError(f"latency budget {text!r}: expected auto, off or milliseconds")
    return ms or None


@dataclass(frozen=True, slots=True)
class TuneSettings:
    """Where the calibration profile comes from (see gpu_worker/tuning/apply.py)."""

    #: Settings a calibration profile may set unless they are given explicitly: the
    #: names that ``explicit`` may hold.
    TUNABLE: ClassVar[tuple[str, ...]] = (
        "max_batch_size", "max_inflight", "channels_last", "autocast", "compile",
        "latency_budget_ms")
    #: Where the profile comes from: the values ``calibrate`` may take.
    CALIBRATE_MODES: ClassVar[tuple[str, ...]] = ("auto", "load", "off")

    #: auto: load the profile, or calibrate quickly and store one when there is none;
    #: load: load it if there is one; off: no profile.
    calibrate: str = "auto"
    #: Profile directory; empty: $REDBATCH_PROFILE_DIR, else ~/.cache/redbatch/profiles.
    profile_dir: str = ""
    #: p95 latency a batch may take, ms: "auto" (the sizes whose p99 at 80% load is no
    #: worse than batch 1's), or None: no limit. A profile is chosen under the budget
    #: it was calibrated with, unless this is given explicitly.
    latency_budget_ms: Budget = "auto"
    #: CUDA: share of device memory kept free; the batch limit drops before it is reached.
    memory_watermark: float = 0.1
    #: Reduced precision (autocast) may be chosen although it changes the plain model's
    #: top class on more than 0.5% of real samples, or was never checked on any.
    allow_reduced_precision: bool = False
    #: Settings given explicitly (flag or variable), which a profile never overrides:
    #: names among TUNABLE.
    explicit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.calibrate not in self.CALIBRATE_MODES:
            raise ValueError("calibrate must be auto, load or off")
        if not 0 <= self.memory_watermark < 1:
            raise ValueError("memory_watermark must be in [0, 1)")
        budget = self.latency_budget_ms
        if budget not in ("auto", None) and not (isinstance(budget, (int, float))
                                                 and 0 < budget < float("inf")):
            raise ValueError("latency_budget_ms must be auto, None or milliseconds > 0")


def default_consumer_name() -> str:
    """Unique per process, readable in XINFO CONSUMERS: host-pid-random."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


#: Built-in chat models: a worker serving one runs the generation loop (PROTOCOL.md
#: "Generation") instead of the image/text batcher.
GENERATION_MODELS = frozenset({"smollm2_135m"})


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """A generation worker's settings (docs/generation.md)."""

    #: Token chunks of one request are coalesced this long before they are written, ms;
    #: 0 writes every step's tokens.
    stream_interval_ms: float = 20.0
    #: Largest max_new_tokens a job may ask for (PROTOCOL.md "Generation limits").
    max_new_tokens: int = MAX_NEW_TOKENS
    #: Sequences in the running batch, at most; and jobs read ahead of it.
    max_running: int = 32
    #: Memory of the KV cache, MiB (its blocks follow from it).
    kv_memory_mib: int = 256


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a worker needs; logged (redacted) at start."""

    redis: RedisSettings = field(default_factory=RedisSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    tune: TuneSettings = field(default_factory=TuneSettings)
    #: Consumer name in the group; unique per worker process.
    consumer: str = field(default_factory=default_consumer_name)
    #: Seconds a result is kept for its client to collect.
    result_ttl_s: int = 600
    #: How long one XREADGROUP blocks when idle, ms (bounds shutdown latency).
    block_ms: int = 500
    #: Exit once the streams are drained and nothing is in flight (tests, batch jobs).
    burst: bool = False
    #: Seconds a graceful shutdown may take to finish in-flight batches.
    shutdown_grace_s: float = 30.0
    #: Pending jobs idle this long are taken over from their (dead or stuck) worker, ms.
    #: Keep it well above the p99 time a job spends in a worker; leases are renewed at 1/3.
    reclaim_idle_ms: int = 60_000
    #: Deliveries after which a job is dead-lettered instead of run again.
    max_deliveries: int = 3
    #: Port of /metrics, /healthz and /readyz; 0 serves none of them.
    metrics_port: int = 9400
    #: Address the metrics server listens on; loopback by default (no authentication),
    #: 0.0.0.0 for Prometheus on other hosts or containers (compose.yaml sets it).
    metrics_host: str = "127.0.0.1"
    #: A batch running longer than this, seconds, means a hung device or model: the worker
    #: exits (code 3) for its supervisor to restart it, and its jobs are taken over.
    batch_timeout_s: float = 120.0
    #: A device call before serving (one warm-up or calibration run at a batch size on every
    #: lane; the first at a size compiles it: 5-35 s on CPU, longer on a busy machine)
    #: taking longer than this, seconds, means a hung device or a deadlock in torch: the
    #: worker exits (code 3), ``redbatch calibrate`` fails (NOTE [ Device watchdog ]).
    warmup_timeout_s: float = 600.0
    #: Replicas each write of results waits for (Redis WAIT, once per write, on the
    #: connection that wrote): 0 does not wait. RELIABILITY.md "What a failover can lose".
    result_replicas: int = 0
    #: The longest that wait may take, ms; then the worker goes on (the master has the
    #: write) and counts it in redbatch_result_waits_total{outcome="short"}.
    result_wait_ms: int = 100
    #: Models served beside ``model`` by the same worker (``--model`` given more than once):
    #: each with its own streams, batcher and runner, sharing the pool and the device.
    more_models: tuple[ModelSettings, ...] = ()
    generation: GenerationSettings = field(default_factory=GenerationSettings)

    def __post_init__(self) -> None:
        names = [m.served_name for m in self.models]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"model {', '.join(twice)} given twice: each model a worker "
                             "serves needs a name of its own")
        if self.result_replicas < 0:
            raise ValueError("result_replicas must be >= 0")
        # WAIT 0 would block for ever; a wait past the socket timeout would drop the link.
        if not 1 <= self.result_wait_ms < self.redis.socket_timeout_s * 1000:
            raise ValueError(f"result_wait_ms must be >= 1 and below the socket timeout "
                             f"({self.redis.socket_timeout_s * 1000:g} ms)")

    @property
    def models(self) -> tuple[ModelSettings, ...]:
        """Every model this worker serves, ``model`` first."""
        return (self.model, *self.more_models)

    def for_model(self, index: int) -> Settings:
        """These settings for the ``index``-th of :attr:`models` alone: what its batcher,
        calibration and runner are built from."""
        return replace(self, model=self.models[index], more_models=())


def default_of(settings_class: type[Any], name: str) -> Any:
    """The default of field ``name`` of the settings dataclass ``settings_class`` (its
    factory's value when it has one): how the CLI shows and uses these defaults without
    restating them. ValueError for a field that does not exist or has no default."""
    for each in fields(settings_class):
        if each.name != name:
            continue
        if each.default is not MISSING:
            return each.default
        if each.default_factory is not MISSING:
            return each.default_factory()
        break
    raise ValueError(f"{settings_class.__name__} has no default for {name!r}")
