"""One worker serving two models (``--model efficientnet_lite0 --model all_minilm_l6_v2``):
real photos and real sentences through one pool and one device, each model with its own
streams, batcher, metrics and heartbeat; and the fair turns policy between them."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import redis
import torch
from conftest import CAT_LABELS, SAMPLES, WorkerFactory, settings_free_env
from redbatch.common.config import LimitSettings, ModelSettings, PoolSettings, Settings
from redbatch.common.protocol import Keys
from redbatch.gpu_worker.batching.scheduler import CREDIT_S, ModelTurns
from redbatch.handlers.text import MAX_TEXTS, MAX_TOKENS
from redbatch.preproc_worker.pool import PreprocPool
from redbatch.preproc_worker.shm import SlotArray
from redbatch.preproc_worker.worker import PreprocDone, Task
from redbatch.producer.client import Client
from test_end_to_end import COFFEE_LABELS
from test_text_model import SENTENCES, reference_vectors

IMAGE, TEXT = "efficientnet_lite0", "all_minilm_l6_v2"
PHOTOS = {"cat.jpg": CAT_LABELS, "coffee.jpg": COFFEE_LABELS}


# ---------------------------------------------------------------------- the turns policy


def test_equal_models_alternate_batch_by_batch() -> None:
    turns = ModelTurns(2)
    order = []
    for _ in range(6):
        first = turns.order()[0]
        order.append(first)
        turns.launched(first)
        turns.ran(first, 0.010)
    assert order == [0, 1, 0, 1, 0, 1]


def test_turns_are_fair_in_device_time_not_in_batches() -> None:
    # Model 0's batches take 2 ms, model 1's 20 ms: with both always ready, each gets
    # about half the device, so model 0 runs about ten batches for each of model 1's.
    turns = ModelTurns(2)
    used = [0.0, 0.0]
    batches = [0, 0]
    for _ in range(400):
        first = turns.order()[0]
        turns.launched(first)
        seconds = (0.002, 0.020)[first]
        turns.ran(first, seconds)
        used[first] += seconds
        batches[first] += 1
    assert abs(used[0] - used[1]) <= 0.020 + 1e-9
    assert 9 <= batches[0] / batches[1] <= 11


def test_a_model_back_from_idle_gets_only_a_little_credit() -> None:
    # Model 1 was idle while model 0 used the device for 10 s: back, it is owed at most
    # CREDIT_S of device time before the two alternate again.
    turns = ModelTurns(2)
    for _ in range(1000):
        turns.launched(0)
        turns.ran(0, 0.010)
    ahead = 0.0
    while turns.order()[0] == 1:
        turns.launched(1)
        turns.ran(1, 0.010)
        ahead += 0.010
    assert CREDIT_S - 1e-9 <= ahead <= CREDIT_S + 0.010 + 1e-9


def test_while_its_batch_runs_a_model_does_not_go_again_before_the_other() -> None:
    turns = ModelTurns(2)
    turns.launched(0)  # not back yet: no run time charged
    assert turns.order()[0] == 1


# ---------------------------------------------------------------------- settings and CLI


def test_a_model_given_twice_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="given twice"):
        Settings(model=ModelSettings(spec=TEXT), more_models=(ModelSettings(spec=TEXT),))
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "worker", "--model", IMAGE,
                           "--model", TEXT, "--model-name", "x", "--redis",
                           "redis://127.0.0.1:1/0"], env=settings_free_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--model-name names one model" in proc.stderr


# ---------------------------------------------------------------------- the shared pool


def wait_records(pool: PreprocPool, tasks: list[Task], timeout_s: float = 120) -> list[PreprocDone]:
    """Start ``pool``, submit ``tasks`` and return their records, in the tasks' order."""
    messages: queue.Queue[list[PreprocDone]] = queue.Queue()
    pool.start(on_records=messages.put)
    keys = pool.submit_many(tasks)
    done: dict[int, PreprocDone] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(tasks) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):  # complete() sends the next tasks on
            done.update((rec.key, rec) for rec in pool.complete(messages.get(timeout=0.1)))
    return [done[key] for key in keys]


def test_one_pool_preprocesses_each_models_inputs_into_its_own_slots() -> None:
    # One process loads both handlers: a photo is decoded into the image model's slots, a
    # sentence tokenised into the text model's, each task naming its model.
    images = SlotArray.create(2, (3, 224, 224), "float32")
    texts = SlotArray.create(2, (MAX_TEXTS, 2, MAX_TOKENS), "int16")
    pool = PreprocPool(IMAGE, LimitSettings(), PoolSettings(processes=1), images.layout,
                       more=[(TEXT, texts.layout)])
    try:
        records = wait_records(pool, [
            Task(1, (SAMPLES / "cat.jpg").read_bytes(), "image/jpeg", model=0),
            Task(1, b"Call me Ishmael.", "text/plain", model=1)])
    finally:
        pool.close()
        try:
            image_slot, text_slot = images.array[1].copy(), texts.array[1].copy()
        finally:
            images.close()
            texts.close()
    assert [(r.error_code, r.cost) for r in records] == [(None, 0), (None, 8)]
    assert float(np.abs(image_slot).sum()) > 0  # normalised pixels
    assert int((text_slot[0, 1] > 0).sum()) == 8  # the attention mask of 8 tokens


def test_the_models_take_turns_in_the_pools_lines() -> None:
    # Twelve photos queued before four texts: the texts are preprocessed in turn with the
    # photos, not after all of them (the order records come back in, whatever the speed).
    images = SlotArray.create(12, (3, 224, 224), "float32")
    texts = SlotArray.create(4, (MAX_TEXTS, 2, MAX_TOKENS), "int16")
    pool = PreprocPool(IMAGE, LimitSettings(), PoolSettings(processes=1), images.layout,
                       more=[(TEXT, texts.layout)])
    photo = (SAMPLES / "cat.jpg").read_bytes()
    order: list[int] = []
    try:
        tasks = [Task(i, photo, "image/jpeg", model=0) for i in range(12)] + \
            [Task(i, b"Call me Ishmael.", "text/plain", model=1) for i in range(4)]
        messages: queue.Queue[list[PreprocDone]] = queue.Queue()
        pool.start(on_records=messages.put)
        keys = pool.submit_many(tasks)
        model_of = {key: task.model for key, task in zip(keys, tasks, strict=True)}
        deadline = time.monotonic() + 120
        while len(order) < len(tasks) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                order += [model_of[r.key] for r in pool.complete(messages.get(timeout=0.1))]
    finally:
        pool.close()
        images.close()
        texts.close()
    assert sorted(order) == [0] * 12 + [1] * 4
    last_text = max(i for i, model in enumerate(order) if model == 1)
    assert last_text < 10, order  # interleaved: about one photo before each text


# ---------------------------------------------------------------------- a real worker


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _executions(text: str, model: str) -> float:
    found = re.search(rf'redbatch_executions_total\{{model="{model}"\}} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_one_worker_serves_photos_and_sentences_with_the_reference_answers(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, reference: object,
        free_port: int) -> None:
    start_worker("--model", TEXT, "--max-batch-size", "8", "--metrics-port", str(free_port),
                 model=IMAGE)
    texts = SENTENCES[:24]
    photos = list(PHOTOS) * 6
    with Client(redis_url, model=IMAGE) as images, Client(redis_url, model=TEXT) as sentences:
        image_handles = images.submit_many([(SAMPLES / name).read_bytes() for name in photos])
        text_handles = sentences.submit_many(texts)
        deadline = time.monotonic() + 180
        labels = [h.result(timeout_s=max(1.0, deadline - time.monotonic()))
                  .raise_for_error().output["label"] for h in image_handles]
        vectors = [h.result(timeout_s=max(1.0, deadline - time.monotonic()))
                   .raise_for_error().output["embedding"] for h in text_handles]
    assert all(label in PHOTOS[name] for name, label in zip(photos, labels, strict=True))
    cosines = (torch.tensor(vectors) * reference_vectors(reference, texts)).sum(dim=1)
    assert float(cosines.min()) >= 0.999
    # Each model's own series and heartbeat.
    text = _metrics(free_port)
    assert _executions(text, IMAGE) >= 1 and _executions(text, TEXT) >= 1
    assert 'redbatch_batch_tokens_total{kind="real",model="all_minilm_l6_v2"}' in text
    status = subprocess.run([sys.executable, "-m", "redbatch.cli", "status", "--json",
                             "--redis", redis_url], env=settings_free_env(),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    models = {m["model"]: m for m in json.loads(status.stdout)["models"]}
    consumers = {name: {w["consumer"] for w in models[name]["workers"]}
                 for name in (IMAGE, TEXT)}
    assert consumers[IMAGE] and consumers[IMAGE] == consumers[TEXT], consumers
    assert all(r.xlen(s) == 0 for name in (IMAGE, TEXT) for s in Keys(name).streams())


@pytest.mark.full
def test_two_models_with_backlogs_share_the_device_as_they_go(
        redis_url: str, start_worker: WorkerFactory) -> None:
    # Both backlogs are queued before the worker starts. Served in fair turns, the text
    # model's first answers come long before the image model's backlog is done (served one
    # model after the other, they would come after its last).
    with Client(redis_url, model=IMAGE) as images, Client(redis_url, model=TEXT) as sentences:
        image_handles = images.submit_many([(SAMPLES / "cat.jpg").read_bytes()] * 96)
        text_handles = sentences.submit_many(SENTENCES[:48] * 2)
        start_worker("--model", TEXT, "--max-batch-size", "8", model=IMAGE)
        deadline = time.monotonic() + 300
        done_image = sorted(h.result(timeout_s=max(1.0, deadline - time.monotonic()))
                            .raise_for_error().finished_ms for h in image_handles)
        done_text = sorted(h.result(timeout_s=max(1.0, deadline - time.monotonic()))
                           .raise_for_error().finished_ms for h in text_handles)
    # Each model's first quarter is answered before the other's last quarter begins.
    assert done_text[len(done_text) // 4] < done_image[3 * len(done_image) // 4]
    assert done_image[len(done_image) // 4] < done_text[3 * len(done_text) // 4]
