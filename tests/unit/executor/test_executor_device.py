"""The executor's --device: what the model runs on and what memsvc is told (a GPU UUID),
with the CUDA queries mocked; --dtype auto follows the device."""
import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.server import resolve_device


@pytest.fixture
def two_gpus(monkeypatch):
    import pagedserve.pool_share.cuda_ipc as ipc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ipc, "gpu_uuids", lambda: ["GPU-aaaa", "GPU-bbbb"])


def test_defaults_are_auto():
    config = ExecutorConfig()
    assert config.device == "auto" and config.dtype == "auto"


def test_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == ("cpu", "cpu")
    assert resolve_device("cpu") == ("cpu", "cpu")
    with pytest.raises(ValueError):
        resolve_device("cuda")


def test_gpu_names_go_to_memsvc_as_uuids(two_gpus):
    assert resolve_device("auto") == ("cuda:0", "GPU-aaaa")
    assert resolve_device("cuda") == ("cuda:0", "GPU-aaaa")
    assert resolve_device("cuda:1") == ("cuda:1", "GPU-bbbb")
    assert resolve_device("GPU-bbbb") == ("cuda:1", "GPU-bbbb")
    assert resolve_device("cpu") == ("cpu", "cpu")


def test_steps_run_with_the_executors_gpu_current(monkeypatch):
    from pagedserve.executor.server import _launch_of

    chosen = []

    class FakeGuard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            chosen.append(self.index)

        def __exit__(self, *exc):
            chosen.append(None)

    monkeypatch.setattr(torch.cuda, "device", FakeGuard)

    class FakeExecutor:
        device = torch.device("cuda", 1)

        def execute(self, batch):
            assert chosen == [1]
            return ["out", batch]

    assert _launch_of(FakeExecutor())("b").outputs == ["out", "b"]
    assert chosen == [1, None]
