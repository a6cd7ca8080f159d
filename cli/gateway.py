"""``redbatch gateway``: serve the OpenAI-compatible HTTP gateway (docs/gateway.md).

The gateway itself is ``gateway/`` (the ``redbatch[gateway]`` extra: Starlette and
uvicorn); this module reads the options and runs it under uvicorn.
"""

from __future__ import annotations

from pathlib import Path

import click
from redbatch.cli import options as o
from redbatch.common.config import DEFAULT_REDIS_URL, GatewaySettings, default_of, redact_url
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import validate_name

EXTRA_HINT = "redbatch gateway needs its extra: pip install 'redbatch[gateway]'"


@click.command()
@o.REDIS()
@o.PREFIX()
@o.opt("--host", env="GATEWAY_HOST", default=default_of(GatewaySettings, "host"),
       help="Address to listen on (0.0.0.0: every interface).")
@o.opt("--port", env="GATEWAY_PORT", type=click.IntRange(0, 65535),
       default=default_of(GatewaySettings, "port"), help="Port to listen on.")
@o.opt("--model", "models", env="GATEWAY_MODELS", multiple=True,
       default=("all_minilm_l6_v2",),
       help="A served model name the gateway offers (repeatable; the variable: names "
            "separated by spaces).")
@o.opt("--tenants", env="GATEWAY_TENANTS", default=None,
       type=click.Path(dir_okay=False, path_type=Path),
       help="TOML file of API keys and tenants (docs/gateway.md) [default: none: no key "
            "is asked for].")
@o.opt("--default-timeout-s", env="GATEWAY_DEFAULT_TIMEOUT_S", type=click.FloatRange(min=0.001),
       default=default_of(GatewaySettings, "default_timeout_s"),
       help="A request's deadline when it names no timeout, s.")
@o.opt("--submit-calls-in-flight", env="GATEWAY_SUBMIT_CALLS_IN_FLIGHT",
       type=click.IntRange(min=1), default=default_of(GatewaySettings, "submit_calls_in_flight"),
       help="Admission calls of one tenant out at once; requests arriving meanwhile go "
            "together in the next call.")
@o.opt("--sse-keepalive-s", env="GATEWAY_SSE_KEEPALIVE_S", type=click.FloatRange(min=0.01),
       default=default_of(GatewaySettings, "sse_keepalive_s"),
       help="Longest silence of a streamed answer: a stream starts after this long without "
            "its first chunk, and sends a comment line whenever no chunk came for this "
            "long, so that proxies keep it open.")
@o.LOG_LEVEL()
def gateway(redis_url: str | None, prefix: str, host: str, port: int, models: tuple[str, ...],
            tenants: Path | None, default_timeout_s: float, submit_calls_in_flight: int,
            sse_keepalive_s: float, log_level: str) -> None:
    """Serve the OpenAI-compatible HTTP gateway: /v1/chat/completions, /v1/completions,
    /v1/embeddings, native /v1/models/M/jobs and /v1/jobs/ID, /v1/models, /metrics,
    /healthz, /readyz.

    Stateless: it keeps no queue of its own, so run as many as you like behind a load
    balancer; every request becomes the protocol's calls on --redis.
    """
    setup_logging(log_level)
    try:
        import uvicorn
        from redbatch.gateway.app import create_app
        from redbatch.gateway.service import Gateway
        from redbatch.gateway.tenants import TenantsError, load_tenants, open_tenants
    except ImportError as e:
        raise click.ClickException(f"{EXTRA_HINT} ({e})") from None
    try:
        names = [validate_name(m) for m in models]
        known = load_tenants(tenants) if tenants else open_tenants()
    except (ValueError, TenantsError) as e:
        raise click.UsageError(str(e)) from None
    url = redis_url or DEFAULT_REDIS_URL
    settings = GatewaySettings(host=host, port=port, default_timeout_s=default_timeout_s,
                               submit_calls_in_flight=submit_calls_in_flight,
                               sse_keepalive_s=sse_keepalive_s)
    app = create_app(Gateway(settings, url, known, names, prefix))
    click.echo(f"redbatch gateway: http://{host}:{port} on {redact_url(url)}, models "
               f"{', '.join(names)}, {len(known.all)} tenant(s)"
               + ("" if tenants else " (no tenants file: no API key asked)"), err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                lifespan="on", server_header=False)
