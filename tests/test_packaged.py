"""Compiled packages (gpu_worker/device/packaged.py): built once with AOTInductor, loaded in a
moment, the same answers as the model at every batch size, and the GIL free while it runs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from redbatch.gpu_worker.device.packaged import (
    load_or_build,
    package_or_none,
    package_path,
    packaged,
)
from redbatch.gpu_worker.tuning.profile import Variant

CL_COMPILE = Variant(channels_last=True, compile=True)
SHAPE = (3, 32, 32)
MAX_BATCH = 8

pytestmark = pytest.mark.skipif(not packaged(CL_COMPILE, torch.device("cpu")),
                                reason="this torch makes no AOTInductor packages")


class SmallNet(torch.nn.Module):
    """A small convolutional classifier: what the package path does to EfficientNet, in
    seconds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


def _inputs(n: int) -> torch.Tensor:
    return torch.randn(n, *SHAPE).contiguous(memory_format=torch.channels_last)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[SmallNet, Path, str]:
    model = SmallNet().eval()
    path = package_path(tmp_path_factory.mktemp("profiles") / "small--cpu.json", "sha256:x",
                        CL_COMPILE, MAX_BATCH, torch.device("cpu"))
    _, note = load_or_build(model, CL_COMPILE, SHAPE, "float32", MAX_BATCH,
                            torch.device("cpu"), path, runners=2)
    return model, path, note


def test_a_package_is_built_once_then_loaded(built: tuple[SmallNet, Path, str]) -> None:
    model, path, note = built
    assert note.startswith("built compiled package") and path.is_file()
    assert path.name.startswith("small--cpu--channels_last+compile--") and path.suffix == ".so"
    start = time.perf_counter()
    _, again = load_or_build(model, CL_COMPILE, SHAPE, "float32", MAX_BATCH,
                             torch.device("cpu"), path, runners=2)
    assert again.startswith("loaded compiled package"), again
    assert time.perf_counter() - start < 5
    other = package_path(path.parent / "small--cpu.json", "sha256:y", CL_COMPILE, MAX_BATCH,
                         torch.device("cpu"))
    assert other != path, "another model (fingerprint) gets another package"


def test_a_package_answers_as_the_model_at_every_batch_size(
        built: tuple[SmallNet, Path, str]) -> None:
    model, path, _ = built
    compiled, _ = load_or_build(model, CL_COMPILE, SHAPE, "float32", MAX_BATCH,
                                torch.device("cpu"), path, runners=1)
    with torch.inference_mode():
        for n in (1, 3, MAX_BATCH):
            x = _inputs(n)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_a_damaged_package_is_built_again(built: tuple[SmallNet, Path, str],
                                          tmp_path: Path) -> None:
    model, _, _ = built
    path = tmp_path / "damaged.so"
    path.write_bytes(b"not a shared library")
    compiled, note = load_or_build(model, CL_COMPILE, SHAPE, "float32", MAX_BATCH,
                                   torch.device("cpu"), path, runners=1)
    assert note.startswith("built compiled package"), note
    with torch.inference_mode():
        x = _inputs(2)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.serial
def test_the_gil_is_free_while_a_package_runs(built: tuple[SmallNet, Path, str]) -> None:
    """Python threads (the worker's intake, pump, writer) keep running beside the model:
    the call goes through ctypes, which releases the GIL. Measured as a counting thread's
    progress during many calls against its progress alone, for the same time."""
    model, path, _ = built
    compiled, _ = load_or_build(model, CL_COMPILE, SHAPE, "float32", MAX_BATCH,
                                torch.device("cpu"), path, runners=1)
    x = _inputs(MAX_BATCH).repeat(8, 1, 1, 1)[:MAX_BATCH]
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    def counted(seconds: float, work: bool) -> float:
        before, start = count[0], time.perf_counter()
        with torch.inference_mode():
            while time.perf_counter() - start < seconds:
                if work:
                    compiled(x)
                else:
                    time.sleep(0.001)
        return (count[0] - before) / (time.perf_counter() - start)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        alone = counted(0.5, work=False)
        beside = counted(0.5, work=True)
    finally:
        stop.set()
        thread.join()
    # Held for the whole call, the counter would crawl (10% with the package's own loader).
    assert beside > 0.3 * alone, (beside, alone)


class Branchy(SmallNet):
    """Control flow on the data: torch.compile takes it (a graph break), export does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if bool(x.sum() > 0) else -out


def test_a_model_that_cannot_be_packaged_falls_back_with_a_note(tmp_path: Path) -> None:
    """A worker never fails to start because its model cannot be exported: no package,
    nothing left behind, and a note saying torch.compile takes over."""
    path = tmp_path / "branchy.so"
    compiled, note = package_or_none(Branchy().eval(), CL_COMPILE, SHAPE, "float32",
                                     MAX_BATCH, torch.device("cpu"), path, runners=1)
    assert compiled is None and "torch.compile compiles each batch size" in note, note
    assert list(tmp_path.iterdir()) == []
