"""The default model on real photos, through the same preprocess and device path the worker uses."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CAT_LABELS, SAMPLES
from PIL import Image
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.device.prepare import OOM_HOLD_S, next_batch_limit, resolve_device
from redbatch.gpu_worker.device.runner import ModelRunner
from redbatch.gpu_worker.tuning.profile import Variant
from redbatch.gpu_worker.tuning.variants import cxx_compiler_found
from redbatch.handlers.base import Handler
from redbatch.handlers.decode import normalise_into, open_image, resize_center_crop
from redbatch.handlers.efficientnet_lite import load_efficientnet_lite0
from redbatch.handlers.imagenet import EfficientNetLite0, imagenet_labels
from redbatch.preproc_worker.shm import SlotArray

#: torch.compile on CPU builds C++ kernels (inductor): the compiled-path tests need a compiler.
NEEDS_CXX = pytest.mark.skipif(not cxx_compiler_found(), reason="no C++ compiler for inductor")
COFFEE_LABELS = {"espresso", "cup", "coffee mug"}


@dataclass
class Device:
    """The worker's device path over real shared-memory slots, without Redis or a pool."""

    runner: ModelRunner
    slots: SlotArray

    @property
    def handler(self) -> Handler:
        return self.runner.handler


@pytest.fixture(scope="module")
def runner() -> Iterator[Device]:
    handler = EfficientNetLite0(LimitSettings())
    slots = SlotArray.create(8, handler.input_shape, handler.input_dtype)
    run = ModelRunner(handler, resolve_device("cpu"), slots.array, max_batch_size=8)
    yield Device(run, slots)
    run.close()
    slots.close()


def classify(device: Device, payloads: list[bytes]) -> list[dict[str, Any]]:
    for i, data in enumerate(payloads):
        device.handler.preprocess(data, "", {}, device.slots.array[i])
    outcomes = device.runner.run(list(range(len(payloads))), [{}] * len(payloads))
    assert all(o.error is None for o in outcomes)
    return [o.output for o in outcomes]


def test_checkpoint_loads_strictly_and_labels_are_imagenet() -> None:
    model = load_efficientnet_lite0()  # strict=True inside; a missing key would raise
    assert sum(p.numel() for p in model.parameters()) > 4_000_000
    labels = imagenet_labels()
    assert len(labels) == 1000 and labels[281] == "tabby" and labels[967] == "espresso"


def test_real_photos_get_the_right_classes(runner: Device) -> None:
    cat, coffee = ((SAMPLES / n).read_bytes() for n in ("cat.jpg", "coffee.jpg"))
    out = classify(runner, [cat, coffee])
    assert out[0]["label"] in CAT_LABELS and out[1]["label"] in COFFEE_LABELS
    assert out[1]["score"] > 0.5
    for o in out:
        assert [t["score"] for t in o["top5"]] == sorted((t["score"] for t in o["top5"]),
                                                         reverse=True)
        assert set(o["top5"][0]) == {"label", "class_id", "score"}
        assert o["top5"][0]["label"] == o["label"]


def test_batched_and_single_runs_agree(runner: Device) -> None:
    cat = (SAMPLES / "cat.jpg").read_bytes()
    single = classify(runner, [cat])[0]
    batched = classify(runner, [cat] * 5)
    assert all(b["class_id"] == single["class_id"] for b in batched)
    assert all(abs(b["score"] - single["score"]) < 1e-4 for b in batched)


def test_draft_decoding_of_a_large_jpeg_keeps_the_prediction(runner: Device) -> None:
    photo = Image.open(SAMPLES / "cat.jpg").convert("RGB")
    big = photo.resize((photo.width * 4, photo.height * 4), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    big.save(buf, "JPEG", quality=92)
    drafted = classify(runner, [buf.getvalue()])[0]
    full = np.empty((3, 224, 224), np.float32)
    img = open_image(buf.getvalue(), LimitSettings())  # no draft: full-size decode
    normalise_into(resize_center_crop(img, 256, 224), full, 127.0, 128.0)
    model = load_efficientnet_lite0()
    with torch.inference_mode():
        logits = model(torch.from_numpy(full)[None])
    assert int(logits.argmax()) == drafted["class_id"]
    assert drafted["label"] in CAT_LABELS


# ------------------------------------------------------------------ device path on CPU


class Tiny:
    """A handler around any callable, for the device path's own logic."""

    input_shape = (3, 4, 4)
    input_dtype = "float32"

    def __init__(self, model: Any) -> None:
        self.model = model

    def preprocess(self, payload: bytes, content_type: str, params: Any, out: Any) -> None:
        raise NotImplementedError

    def load(self, device: torch.device) -> Any:
        return self.model

    def postprocess(self, outputs: torch.Tensor, params: Any) -> list[Any]:
        return outputs.tolist()


def tiny_slots(n: int) -> np.ndarray:
    slots = np.zeros((n, 3, 4, 4), np.float32)
    for i in range(n):
        slots[i] = i  # slot i holds the value i everywhere
    return slots


def test_channels_last_gives_the_plain_outputs(runner: Device) -> None:
    cat, coffee = ((SAMPLES / n).read_bytes() for n in ("cat.jpg", "coffee.jpg"))
    for i, data in enumerate([cat, coffee, cat]):
        runner.handler.preprocess(data, "", {}, runner.slots.array[i])
    plain = runner.runner.submit([0, 1, 2], [{}] * 3)
    cl = ModelRunner(EfficientNetLite0(LimitSettings()), resolve_device("cpu"),
                     runner.slots.array, 8, Variant(channels_last=True))
    fast = cl.submit([0, 1, 2], [{}] * 3)
    assert plain.outputs is not None and fast.outputs is not None
    assert fast.outputs.shape == (3, 1000)
    torch.testing.assert_close(fast.outputs, plain.outputs, rtol=1e-4, atol=1e-3)
    outs = cl.collect(fast)
    assert outs[0].output["label"] in CAT_LABELS and outs[1].output["label"] in COFFEE_LABELS
    cl.close()


def test_bf16_autocast_on_cpu_keeps_the_top_class_and_returns_float32(runner: Device) -> None:
    runner.handler.preprocess((SAMPLES / "coffee.jpg").read_bytes(), "", {},
                              runner.slots.array[0])
    plain = runner.runner.submit([0], [{}])
    bf16 = ModelRunner(EfficientNetLite0(LimitSettings()), resolve_device("cpu"),
                       runner.slots.array, 8, Variant(autocast="bfloat16"))
    job = bf16.submit([0], [{}])
    assert job.error is None and job.outputs is not None and plain.outputs is not None
    assert int(job.outputs.argmax()) == int(plain.outputs.argmax())
    (out,) = bf16.collect(job)
    assert out.output["label"] in COFFEE_LABELS
    bf16.close()


def test_cpu_path_is_plain_no_streams_no_pinning() -> None:
    run = ModelRunner(Tiny(lambda x: x.mean(dim=(1, 2, 3))), torch.device("cpu"),
                      tiny_slots(4), 4)
    assert not run.pipelined and run._copy_stream is None and run._compute_stream is None
    assert not any(h.is_pinned() for h in run._host)
    job = run.submit([3, 1], [{}, {}])
    assert job.done is None and job.outputs is not None, "computed at submit on CPU"
    assert [o.output for o in run.collect(job)] == [3.0, 1.0] and job.run_s > 0


def test_double_buffers_never_let_a_later_batch_overwrite_earlier_outputs() -> None:
    # The model returns a view into its input, i.e. into the host buffer itself.
    run = ModelRunner(Tiny(lambda x: x[:, 0, 0, 0]), torch.device("cpu"), tiny_slots(6), 2)
    first = run.submit([1, 2], [{}, {}])
    second = run.submit([3, 4], [{}, {}])
    third = run.submit([5, 0], [{}, {}])  # back in the first batch's buffer
    assert [o.output for o in run.collect(first)] == [1.0, 2.0]
    assert [o.output for o in run.collect(second)] == [3.0, 4.0]
    assert [o.output for o in run.collect(third)] == [5.0, 0.0]


def test_padding_runs_the_preferred_size_and_returns_only_real_rows() -> None:
    seen: list[int] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append(len(x))
        return x.mean(dim=(1, 2, 3))

    run = ModelRunner(Tiny(model), torch.device("cpu"), tiny_slots(8), 8)
    outs = run.run([2, 5, 7], [{}] * 3, pad_to=8)
    assert seen == [8] and [o.output for o in outs] == [2.0, 5.0, 7.0]
    job = run.submit([1, 2], [{}] * 2, pad_to=16)  # over the max batch: an error, not a crash
    assert isinstance(job.error, ValueError)


def test_collect_isolates_the_failing_request() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0, 0, 0] == 3).any():
            raise RuntimeError("bad input")
        return x.mean(dim=(1, 2, 3))

    run = ModelRunner(Tiny(model), torch.device("cpu"), tiny_slots(6), 4)
    outs = run.collect(run.submit([1, 3, 5, 2], [{}] * 4))
    assert [o.output for o in outs] == [1.0, None, 5.0, 2.0]
    assert outs[1].error is not None and "bad input" in outs[1].message


def test_warmup_times_each_size_once_warm() -> None:
    run = ModelRunner(Tiny(lambda x: x.mean(dim=(1, 2, 3))), torch.device("cpu"),
                      tiny_slots(4), 4)
    timings = run.warmup([1, 4, 9])
    assert sorted(timings) == [1, 4] and all(t > 0 for t in timings.values())


@pytest.mark.parametrize("limit, headroom_mib, expected", [
    (64, 500, 32),     # under the 1 GiB watermark: halve
    (1, 10, 1),        # never below 1
    (32, 1024 + 2 * 32 * 10 + 1, 64),  # room for the watermark and twice the activations: double
    (32, 1024 + 100, 32),  # above the watermark but not by much: keep
    (64, 100_000, 64),  # never past the max
])
def test_memory_watermark_lowers_and_restores_the_batch_limit(limit: int, headroom_mib: int,
                                                              expected: int) -> None:
    mib = 2**20
    assert next_batch_limit(limit, 64, headroom_mib * mib, 1024 * mib, 10 * mib) == expected


def test_a_batch_that_ran_out_of_memory_is_split_and_not_tried_again_soon() -> None:
    """Out of memory past 16: the batch is split until it fits, every input answered, and
    however much memory looks free afterwards the limit stays under the size that failed
    for OOM_HOLD_S (doubling straight back ran out again every few batches on an H200)."""
    def model(x: torch.Tensor) -> torch.Tensor:
        if len(x) > 16:
            raise torch.cuda.OutOfMemoryError("injected: past 16 items")
        return x.mean(dim=(1, 2, 3))

    run = ModelRunner(Tiny(model), torch.device("cpu"), tiny_slots(64), 64)
    outcomes = run.run_isolating(list(range(64)), [{}] * 64)
    assert [o.output for o in outcomes] == pytest.approx(list(range(64)))
    assert run.batch_limit == 16
    now, plenty = time.monotonic(), 100 * 2**30
    run.follow_memory(plenty, now + 1)
    assert run.batch_limit == 16
    run.follow_memory(plenty, now + OOM_HOLD_S + 1)
    assert run.batch_limit == 32


def test_cpu_lanes_run_batches_at_once_and_keep_them_apart() -> None:
    import time as clock

    def model(x: torch.Tensor) -> torch.Tensor:
        clock.sleep(0.3)  # a forward pass that leaves the GIL, as torch's kernels do
        if (x[:, 0, 0, 0] == 5).any():
            raise RuntimeError("bad input")
        return x[:, 0, 0, 0]  # a view into the host buffer

    run = ModelRunner(Tiny(model), torch.device("cpu"), tiny_slots(8), 2, lanes=2)
    assert run.depth == 2 and not run.pipelined
    run.run([0, 1], [{}] * 2)  # the first call at a size runs alone (NOTE [ First calls ])
    start = clock.perf_counter()
    first, second = run.submit([1, 2], [{}] * 2), run.submit([3, 4], [{}] * 2)
    assert first.done is not None, "handed to a lane, not run at submit"
    third = run.submit([6, 7], [{}] * 2)  # reuses the first's buffer once it is done
    assert [o.output for o in run.collect(first)] == [1.0, 2.0]
    assert [o.output for o in run.collect(second)] == [3.0, 4.0]
    assert clock.perf_counter() - start < 0.55, "the first two ran at once"
    assert [o.output for o in run.collect(third)] == [6.0, 7.0]
    outs = run.collect(run.submit([5, 0], [{}] * 2))  # failing in a lane: isolated
    assert outs[0].error is not None and outs[1].output == 0.0
    run.close()


@NEEDS_CXX
@pytest.mark.full
def test_compiled_lanes_compile_each_size_once_past_torchs_default_limit() -> None:
    # Two lanes meeting a new size at once used to compile it twice, and lane threads did
    # not see the raised recompile limit (torch keeps config per thread): after 8 graphs
    # torch fell back to eager without an error. 9 sizes, two batches at a time.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU())
    eager = [conv(torch.from_numpy(tiny_slots(9)[:1]) * 0 + i).mean().item() for i in range(9)]
    run = ModelRunner(Tiny(lambda x: conv(x).mean(dim=(1, 2, 3))), torch.device("cpu"),
                      tiny_slots(9), 9, Variant(compile=True), lanes=2)
    for size in range(1, 10):
        ids = list(range(size))
        jobs = [run.submit(ids, [{}] * size), run.submit(ids, [{}] * size)]
        for job in jobs:
            assert [o.output for o in run.collect(job)] == pytest.approx(eager[:size], abs=1e-5)
    assert counters["stats"]["unique_graphs"] == 9
    run.close()
    torch._dynamo.reset()


@NEEDS_CXX
def test_a_compiled_model_runs_a_split_batch_at_a_compiled_size() -> None:
    # Isolating a failure splits a batch (8 -> 4 + 3 + ...): no new graph while serving.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    conv = torch.nn.Conv2d(3, 2, 3, padding=1)
    run = ModelRunner(Tiny(lambda x: conv(x).mean(dim=(1, 2, 3))), torch.device("cpu"),
                      tiny_slots(6), 6, Variant(compile=True), lanes=2)
    run.warmup([2, 4])
    job = run.submit([5, 1, 3], [{}] * 3)
    outs = run.collect(job)
    assert job.size == 4 and len(outs) == 3
    assert [o.output for o in outs] == pytest.approx(
        [conv(torch.full((1, 3, 4, 4), float(i))).mean().item() for i in (5, 1, 3)], abs=1e-5)
    assert counters["stats"]["unique_graphs"] == 2, "only the two warmed-up sizes"
    run.close()
    torch._dynamo.reset()


def test_first_calls_at_a_size_are_serialised_across_lanes_and_steady_calls_are_not() -> None:
    # issue 27: two CPU lanes first-running an autocast (or compiled) module at the same size
    # deadlocked inside torch. The first call at each size runs alone; later calls meet.
    import threading
    import time as clock

    guard, seen = threading.Lock(), set()
    inside, most, meet = [0], [0], threading.Event()
    steady = threading.Barrier(2, timeout=10)

    def model(x: torch.Tensor) -> torch.Tensor:
        if len(x) in seen:
            if meet.is_set():
                steady.wait()  # both lanes' steady calls must be inside at once
        else:
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            clock.sleep(0.3)  # a first call (a compile, lazy init) leaves the GIL
            seen.add(len(x))
            with guard:
                inside[0] -= 1
        return x.mean(dim=(1, 2, 3))

    run = ModelRunner(Tiny(model), torch.device("cpu"), tiny_slots(8), 4,
                      Variant(autocast="bfloat16"), lanes=2)
    for size in (2, 4, 2, 4):
        if size == 2 and seen:
            meet.set()
        ids = list(range(size))
        jobs = [run.submit(ids, [{}] * size), run.submit(ids, [{}] * size)]
        for job in jobs:
            assert [o.output for o in run.collect(job)] == pytest.approx(ids, abs=0.1)
    assert most[0] == 1, "two lanes were inside a first call at once"
    run.close()
