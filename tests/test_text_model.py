"""The text model (all_minilm_l6_v2): its encoder against the reference implementation,
its limits, and a real worker serving real sentences through the whole pipeline.

The reference is sentence-transformers reading the same files from the model's wheel; its
vectors for every text compared here were computed once by tests/make_minilm_golden.py into
tests/data/minilm_golden.json (conftest's ``reference``), so neither the tests nor the
workers import it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import queue
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WorkerFactory, settings_free_env
from hypothesis import given, settings
from hypothesis import strategies as st
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.gpu_worker.tuning.shapes import shape_grid
from redbatch.handlers.base import load_handler
from redbatch.handlers.decode import InputError
from redbatch.handlers.text import MAX_TEXT_BYTES, MAX_TEXTS, MAX_TOKENS, AllMiniLmL6V2
from redbatch.preproc_worker.worker import PreprocDone
from redbatch.producer.client import Client

MODEL = "all_minilm_l6_v2"
LONG = ("The committee reviewed the proposal in detail, weighing the benefits for residents "
        "against the costs of maintenance and the impact on the wetlands. ") * 12
SENTENCES = [*(Path(__file__).parent / "data" / "sentences.txt").read_text().splitlines(),
             "", LONG]
PARAPHRASES = [  # (a, its paraphrase, an unrelated sentence)
    ("How do I reset my password?", "I forgot my login details and cannot sign in.",
     "Bees communicate the location of flowers through a waggle dance."),
    ("A man is eating food.", "Someone is having a meal.",
     "Interest rates were left unchanged at the central bank's meeting."),
    ("The train was delayed by forty minutes.", "My train arrived forty minutes late.",
     "Add two cups of flour and a pinch of salt."),
    ("The striker scored twice to win the final.", "Two goals from the forward won the cup.",
     "The patient reported mild chest pain."),
]


@pytest.fixture(scope="module")
def handler() -> AllMiniLmL6V2:
    h = load_handler(MODEL, LimitSettings())
    assert isinstance(h, AllMiniLmL6V2)
    return h


def reference_vectors(reference: object, texts: Sequence[str]) -> torch.Tensor:
    vectors = reference.encode(list(texts), normalize_embeddings=True)  # type: ignore[attr-defined]
    return torch.as_tensor(np.asarray(vectors))


def embed(handler: AllMiniLmL6V2, texts: Sequence[str]) -> torch.Tensor:
    """What a worker computes: preprocess into slots, one batch through the loaded model."""
    slots = np.empty((len(texts), *handler.input_shape), dtype=handler.input_dtype)
    for text, slot in zip(texts, slots, strict=True):
        handler.preprocess(text.encode(), "text/plain", {}, slot)
    with torch.inference_mode():  # each slot's first row: its vector, then its kind
        return _encoder(handler)(torch.from_numpy(slots))[:, 0, :-1]


@functools.cache
def _encoder(handler: AllMiniLmL6V2) -> Callable[[torch.Tensor], torch.Tensor]:
    return handler.load(torch.device("cpu"))  # loaded once per handler, not per call


def test_embeddings_match_sentence_transformers_on_varied_real_sentences(
        handler: AllMiniLmL6V2, reference: object) -> None:
    # Everyday, literary, technical, non-Latin, emoji, one word, empty, and past 256 tokens,
    # all in one batch: padded to its longest, each text's vector must not change.
    assert len(SENTENCES) >= 50
    mine, theirs = embed(handler, SENTENCES), reference_vectors(reference, SENTENCES)
    cosines = (mine * theirs).sum(dim=1)
    worst = int(cosines.argmin())
    assert float(cosines[worst]) >= 0.999, SENTENCES[worst][:80]
    assert torch.allclose(mine.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_a_batch_gives_each_text_the_vector_it_gets_alone(handler: AllMiniLmL6V2) -> None:
    texts = ["Yes.", LONG, "Call me Ishmael."]
    together = embed(handler, texts)
    for i, text in enumerate(texts):
        assert float(embed(handler, [text])[0] @ together[i]) >= 0.9999


def test_paraphrases_score_higher_than_unrelated_sentences(handler: AllMiniLmL6V2) -> None:
    for a, same, other in PARAPHRASES:
        v = embed(handler, [a, same, other])
        assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2, (a, same, other)


def test_long_texts_are_cut_at_the_models_limit_and_bad_ones_refused(
        handler: AllMiniLmL6V2) -> None:
    out = np.empty(handler.input_shape, dtype=handler.input_dtype)
    assert handler.preprocess(LONG.encode(), "", {}, out) == (MAX_TOKENS, 1)
    assert int(out[0, 1].sum()) == MAX_TOKENS and out[0, 0, MAX_TOKENS - 1] == 102  # [SEP]
    handler.preprocess(json.dumps("Call me Ishmael.").encode(), "application/json", {}, out)
    assert int(out[0, 1].sum()) == 8  # [CLS] call me is ##hma ##el . [SEP]
    assert not out[1:].any()  # one text: one row
    refused = {b"\xff\xfe not text": ErrorCode.BAD_INPUT,
               b"x" * (MAX_TEXT_BYTES + 1): ErrorCode.PAYLOAD_TOO_LARGE}
    for payload, code in refused.items():
        with pytest.raises(InputError) as e:
            handler.preprocess(payload, "text/plain", {}, out)
        assert e.value.code is code
    too_many = json.dumps(["a"] * (MAX_TEXTS + 1)).encode()
    for payload in (b"[]", b'["a", 2]', b'{"text": "a"}', b"3", too_many, b"{not json"):
        with pytest.raises(InputError) as e:
            handler.preprocess(payload, "application/json", {}, out)
        assert e.value.code is ErrorCode.BAD_INPUT, payload


def test_a_list_of_texts_fills_a_row_each_and_gets_a_vector_each(
        handler: AllMiniLmL6V2, reference: object) -> None:
    # Three texts as one JSON list: a row each (marked as list items), the cost of the
    # longest and three rows for the batcher, and {"embeddings": [...]} in their order,
    # each the reference's vector; a plain text in the same batch keeps {"embedding"}.
    texts = ["Yes.", LONG, "Call me Ishmael."]
    slots = np.zeros((2, *handler.input_shape), dtype=handler.input_dtype)
    assert handler.preprocess(json.dumps(texts).encode(), "application/json", {},
                              slots[0]) == (MAX_TOKENS, 3)
    assert [int(slots[0, i, 1].max()) for i in range(4)] == [2, 2, 2, 0]
    assert handler.preprocess(b"A man is eating food.", "", {}, slots[1]) == (8, 1)
    with torch.inference_mode():
        listed, plain = handler.postprocess(_encoder(handler)(torch.from_numpy(slots)),
                                            [{}, {}])
    assert set(listed) == {"embeddings"} and set(plain) == {"embedding"}
    got = torch.tensor(listed["embeddings"] + [plain["embedding"]])
    theirs = reference_vectors(reference, [*texts, "A man is eating food."])
    assert float((got * theirs).sum(dim=1).min()) >= 0.999


def test_a_worker_answers_texts_with_the_reference_vectors(
        redis_url: str, start_worker: WorkerFactory, reference: object) -> None:
    # Real pool processes tokenise into shared memory; the worker batches and encodes.
    start_worker("--max-batch-size", "8", model=MODEL)
    texts = SENTENCES[:24]
    with Client(redis_url, model=MODEL) as client:
        handles = [client.submit(text) for text in texts]
        listed = client.submit(SENTENCES[24:40])  # a JSON list: one job, sixteen texts
        bad = client.submit(b"\xff\xfe", content_type="text/plain")
        deadline = time.monotonic() + 120
        results = [h.result(timeout_s=max(1.0, deadline - time.monotonic())) for h in handles]
        vectors = listed.result(timeout_s=60).raise_for_error().output["embeddings"]
        refused = bad.result(timeout_s=60)
    assert refused.error_code is ErrorCode.BAD_INPUT
    got = torch.tensor([r.raise_for_error().output["embedding"] for r in results] + vectors)
    cosines = (got * reference_vectors(reference, SENTENCES[:40])).sum(dim=1)
    assert float(cosines.min()) >= 0.999


def test_score_embeds_the_texts_of_txt_and_jsonl_manifests(
        redis_url: str, start_worker: WorkerFactory, reference: object, tmp_path: Path) -> None:
    # A .txt read with --texts (a text a line, blank lines skipped) and a .jsonl of
    # {"id", "text"} rows, on the bulk lane, through `redbatch score`.
    start_worker("--max-batch-size", "8", model=MODEL)
    lines = SENTENCES[:30]
    (tmp_path / "texts.txt").write_text("\n".join(lines[:20]) + "\n\n", encoding="utf-8")
    rows = [{"id": f"row-{i}", "text": text} for i, text in enumerate(lines[20:])]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows),
                                          encoding="utf-8")
    out = tmp_path / "vectors.jsonl"
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "score", "--texts",
                           str(tmp_path / "texts.txt"), str(tmp_path / "texts.jsonl"),
                           "-o", str(out), "--redis", redis_url, "--model", MODEL],
                          env=settings_free_env(), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {rec["id"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    ids = [f"texts.txt:{n}" for n in range(1, 21)] + [r["id"] for r in rows]
    assert sorted(records) == sorted(ids)
    assert all(records[i]["status"] == "ok" for i in ids), records
    got = torch.tensor([records[i]["output"]["embedding"] for i in ids])
    assert float((got * reference_vectors(reference, lines)).sum(dim=1).min()) >= 0.999


def test_the_pool_reports_each_texts_tokens_as_its_cost() -> None:
    # The cost crosses from the pool process in the record, beside the slot it filled.
    from redbatch.common.config import PoolSettings
    from redbatch.preproc_worker.pool import PreprocPool
    from redbatch.preproc_worker.shm import SlotArray

    texts = [b"Yes.", b"Call me Ishmael.", LONG.encode(), b"\xff"]
    slots = SlotArray.create(4, (MAX_TEXTS, 2, MAX_TOKENS), "int16")
    pool = PreprocPool(MODEL, LimitSettings(), PoolSettings(processes=1), slots.layout)
    messages: queue.Queue[list[PreprocDone]] = queue.Queue()
    costs: dict[int, tuple[int, ErrorCode | None]] = {}
    try:
        pool.start(on_records=messages.put)
        keys = [pool.submit(i, text, "text/plain", {}) for i, text in enumerate(texts)]
        deadline = time.monotonic() + 60
        while len(costs) < len(texts) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):  # complete() sends the next tasks on
                costs.update((r.key, (r.cost, r.error_code))
                             for r in pool.complete(messages.get(timeout=0.1)))
    finally:
        pool.close()
        slots.close()
    assert [costs[k] for k in keys] == [(4, None), (8, None), (MAX_TOKENS, None),
                                        (0, ErrorCode.BAD_INPUT)]


def test_a_worker_counts_real_and_padded_tokens(
        redis_url: str, start_worker: WorkerFactory, tmp_path: Path) -> None:
    # Two texts in one batch, 4 and 8 tokens: 12 real, 16 padded (2 rows x 8).
    port = _free_port()
    start_worker("--max-batch-size", "2", "--max-wait-ms", "2000", "--metrics-port", str(port),
                 model=MODEL)
    with Client(redis_url, model=MODEL) as client:
        handles = client.submit_many(["Yes.", "Call me Ishmael."])
        assert all(h.result(timeout_s=60).batch_size == 2 for h in handles)
    assert _token_counts(port) == {"real": 12.0, "padded": 16.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("max_batch_tokens", [4096, pytest.param(0, marks=pytest.mark.full)])
def test_a_worker_batches_texts_by_length_unless_told_not_to(
        redis_url: str, start_worker: WorkerFactory, max_batch_tokens: int) -> None:
    # Four short texts and four long ones arrive together. By length (the default), each
    # group runs in a batch of its own and hardly any token is padding; plain size batching
    # (--max-batch-tokens 0) runs all eight padded to the longest.
    port = _free_port()
    # One submission (one pipelined call) and a long wait: all eight are waiting together
    # before any batch is due, however busy the machine is.
    start_worker("--max-batch-size", "8", "--max-wait-ms", "1500", "--max-batch-tokens",
                 str(max_batch_tokens), "--metrics-port", str(port), model=MODEL)
    short, long = ["Yes.", "Call me Ishmael.", "a", "lol idk"], [LONG[:900 + i] for i in range(4)]
    with Client(redis_url, model=MODEL) as client:
        handles = client.submit_many(short + long)
        sizes = [h.result(timeout_s=120).raise_for_error().batch_size for h in handles]
    counts = _token_counts(port)
    waste = counts["padded"] / counts["real"]
    if max_batch_tokens:
        assert sizes == [4] * 8 and waste < 1.1, (sizes, counts)
    else:
        assert sizes == [8] * 8 and waste > 1.5, (sizes, counts)


def _token_counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {kind: float(n) for kind, n in re.findall(
        r'redbatch_batch_tokens_total\{kind="(\w+)",model="[^"]+"\} ([0-9.e+]+)', text)}


def test_shapes_timed_at_start_stay_within_the_token_budget() -> None:
    assert shape_grid(32, 256, 4096) == [(1, 16), (1, 64), (1, 256), (8, 16), (8, 64),
                                         (8, 256), (32, 16), (32, 64)]
    assert shape_grid(1, 256, 100) == [(1, 16), (1, 64), (1, 256)]  # one row always runs


@pytest.mark.full
def test_a_calibrating_worker_times_text_shapes_and_serves(
        redis_url: str, start_worker: WorkerFactory, tmp_path: Path) -> None:
    # --calibrate auto: no profile for a text model, but its batcher's run-time line is
    # started from batches of a few shapes timed on the model before the first job.
    start_worker("--calibrate", "auto", "--profile-dir", str(tmp_path / "profiles"),
                 "--max-batch-size", "8", model=MODEL)
    with Client(redis_url, model=MODEL) as client:
        assert client.predict("Call me Ishmael.", timeout_s=60, raise_on_error=True).ok
    log = next(tmp_path.glob("worker-*.log")).read_text()
    assert "calibration: not for this model" in log
    timed = re.search(r"(\d+) text batch shapes timed .* about ([0-9.]+) ms \+ ([0-9.]+) ms "
                      r"per 1000 padded tokens", log)
    assert timed and int(timed[1]) == 9 and float(timed[3]) > 0, log[-2000:]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=4096), st.text(max_size=2048).map(str.encode)),
       st.sampled_from(["", "text/plain", "application/json", "application/octet-stream"]))
def test_fuzz_any_payload_is_a_slot_or_a_typed_refusal(payload: bytes, content_type: str) -> None:
    handler = AllMiniLmL6V2(LimitSettings())
    out = np.empty(handler.input_shape, dtype=handler.input_dtype)
    try:
        cost, rows = handler.preprocess(payload, content_type, {}, out)
    except InputError as e:
        assert e.code in (ErrorCode.BAD_INPUT, ErrorCode.PAYLOAD_TOO_LARGE)
        return
    lengths = (out[:, 1] > 0).sum(axis=1)
    assert 1 <= rows <= MAX_TEXTS and 2 <= cost <= MAX_TOKENS  # [CLS] and [SEP] at least
    assert int(lengths.max()) == cost and all(lengths[:rows] >= 2) and not out[rows:].any()
