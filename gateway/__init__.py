"""``redbatch gateway``: an OpenAI-compatible HTTP face of the protocol (docs/gateway.md).

A room beside the CLI, on top of ``producer/``, which it uses as a library: stateless, it
keeps no queue of its own and only translates each request onto the protocol's calls, so
any number of gateways can stand behind one load balancer and every guarantee (durable
queue, lanes, deadlines, cancel) holds through it.

    tenants.py   API keys to tenants, each with its Redis URL (its own ACL user) and bound
    openai_api.py  OpenAI request bodies to jobs, results to OpenAI responses (pure)
    errors.py    what a refusal or an error result is in HTTP: status, body, headers
    service.py   the calls: hold, submit, wait, status, cancel, live models (no HTTP)
    coalesce.py  the submits of concurrent requests in one call
    app.py       the Starlette routes, /metrics, /healthz, /readyz
"""
