"""The Celery application of the Celery peer: one task per image, JSON on the wire.

Imported by the Celery worker (``celery -A peer_systems.celery_app worker``) and by the
bench's clients, which build one app per client thread with :func:`make_app`. Payloads travel
base64-encoded in the task's JSON arguments (Celery's default pickle is not used anywhere).
"""

from __future__ import annotations

import base64
import os
from functools import cache
from typing import Any

from celery import Celery

#: Broker and result backend, the same private redis-server.
URL_ENV = "PEER_REDIS_URL"
TASK = "peers.classify"


def make_app(url: str) -> Celery:
    app = Celery("peers", broker=url, backend=url)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                    broker_connection_retry_on_startup=True, result_expires=600)
    return app


app = make_app(os.environ.get(URL_ENV, "redis://127.0.0.1:6379/0"))


@cache
def _classifier() -> Any:
    from peer_systems.model import Classifier  # in the worker process only: torch is heavy

    return Classifier()


@app.task(name=TASK)
def classify(image_b64: str) -> dict[str, Any]:
    """Top-5 of one image, run alone (batch of one)."""
    return _classifier().classify([base64.b64decode(image_b64)])[0]  # type: ignore[no-any-return]
