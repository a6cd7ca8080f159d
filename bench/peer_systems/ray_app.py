"""Server process of the Ray Serve peer: a local Ray cluster and one batching deployment.

    python bench/peer_systems/ray_app.py --port P [--max-batch-size 16] [--batch-wait-s 0.005]

The deployment decodes and runs the model in ``@serve.batch`` batches; clients POST the raw
image bytes to ``http://127.0.0.1:P/`` (Serve's HTTP proxy) and get the top-5 as JSON. Stops
Serve and Ray on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any, cast

import ray
from ray import serve
from starlette.requests import Request


# max_ongoing_requests above the clients (its default, 5, would cap every batch at 5); no
# per-request access log, so Ray pays no more logging than the other systems.
@serve.deployment(num_replicas=1, max_ongoing_requests=512, ray_actor_options={"num_cpus": 0},
                  logging_config={"log_level": "WARNING", "enable_access_log": False})
class Classify:
    def __init__(self, max_batch_size: int, batch_wait_s: float, threads: int) -> None:
        from peer_systems.model import Classifier

        # Ray sizes OMP_NUM_THREADS to an actor's CPU reservation; torch gets the cores
        # here explicitly, as in every peer.
        self.model = Classifier(threads)
        self.batch.set_max_batch_size(max_batch_size)  # type: ignore[attr-defined]
        self.batch.set_batch_wait_timeout_s(batch_wait_s)  # type: ignore[attr-defined]

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def batch(self, payloads: list[bytes]) -> list[dict[str, Any]]:
        return self.model.classify(payloads)

    async def __call__(self, request: Request) -> dict[str, Any]:
        return await self.batch(await request.body())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--batch-wait-s", type=float, default=0.005)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False,
             object_store_memory=128 * 1024**2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        # mypy keeps a class's own type under a class decorator: @serve.deployment made it this.
        deployment = cast("serve.Deployment", Classify)
        serve.run(deployment.bind(args.max_batch_size, args.batch_wait_s, args.threads),
                  route_prefix="/", blocking=False)
        print("READY", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
