"""User models: a TorchScript file and 'module:factory' handlers, served by real workers."""


from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from conftest import CAT_LABELS, SAMPLES, WorkerFactory
from handlers_for_tests import CRASH
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode, Keys
from redbatch.handlers import TorchScriptClassifier, load_handler
from redbatch.handlers.efficientnet_lite import load_efficientnet_lite0
from redbatch.producer.client import Client

TESTS = str(Path(__file__).resolve().parent)
CAT = (SAMPLES / "cat.jpg").read_bytes()

# Making the TorchScript file uses torch.jit.trace, deprecated upstream but still how most
# users' existing .pt files were made; serving them (torch.jit.load) is what is under test.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")]


@pytest.fixture(scope="module")
def torchscript_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default network, traced to TorchScript, with ImageNet mean/std folded in front of it:
    a stand-in for a user's exported classifier that expects torchvision preprocessing."""
    class FromImageNetNorm(torch.nn.Module):
        mean: torch.Tensor  # buffers, which Module.__getattr__ types as Tensor | Module
        std: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.net = load_efficientnet_lite0()
            self.register_buffer("mean", torch.tensor([123.675, 116.28, 103.53]).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor([58.395, 57.12, 57.375]).view(1, 3, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net((x * self.std + self.mean - 127.0) / 128.0)  # type: ignore[no-any-return]

    path = tmp_path_factory.mktemp("ts") / "classifier.pt"
    with torch.no_grad():
        traced = torch.jit.trace(FromImageNetNorm().eval(), torch.zeros(1, 3, 224, 224))
    traced.save(str(path))
    return path


def test_spec_forms_pick_the_right_handler(torchscript_file: Path) -> None:
    assert isinstance(load_handler(str(torchscript_file), LimitSettings()), TorchScriptClassifier)
    with pytest.raises(ValueError, match="unknown model"):
        load_handler("no_such_model", LimitSettings())
    with pytest.raises(ValueError, match="does not exist"):
        load_handler("/nowhere/model.pt", LimitSettings())


def test_torchscript_model_is_served(redis_url: str, start_worker: WorkerFactory,
                                     torchscript_file: Path) -> None:
    start_worker(model=str(torchscript_file))
    with Client(redis_url, model="classifier") as client:
        result = client.predict(CAT, timeout_s=60)
    assert result.ok and result.output["label"] in CAT_LABELS


def test_factory_model_whose_preprocessing_crashes_on_one_input(
        redis_url: str, start_worker: WorkerFactory, r: redis.Redis) -> None:
    start_worker("--model-name", "crashy", model="handlers_for_tests:crashy",
                 env={"PYTHONPATH": TESTS})
    with Client(redis_url, model="crashy") as client:
        poison = client.submit(CRASH, timeout_s=120)
        good = client.submit_many([CAT] * 6, timeout_s=120)
        assert client.result(poison, timeout_s=120).error_code is ErrorCode.PREPROCESS_CRASHED
        assert all(client.result(i, timeout_s=120).ok for i in good)
        assert client.predict(CAT, timeout_s=60).ok, "the worker still serves"
    keys = Keys("crashy")
    assert all(int(r.xpending(s, "workers")["pending"]) == 0 for s in keys.streams())


def test_unencodable_output_becomes_an_error_result(redis_url: str,
                                                    start_worker: WorkerFactory) -> None:
    start_worker("--model-name", "unencodable", model="handlers_for_tests:unencodable",
                 env={"PYTHONPATH": TESTS})
    with Client(redis_url, model="unencodable") as client:
        result = client.predict(CAT, timeout_s=60)
        assert result.error_code is ErrorCode.INTERNAL and "msgpack" in result.error_message
        assert client.predict(CAT, timeout_s=60).error_code is ErrorCode.INTERNAL
