"""--device and --dtype auto, with the CUDA queries mocked (no GPU here)."""
import pytest
import torch

from pagedserve.pool_share import device as dev


def fake_cuda(monkeypatch, count, current=0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_auto_is_the_cpu_without_a_gpu(monkeypatch):
    fake_cuda(monkeypatch, 0)
    assert dev.resolve_device("auto") == "cpu"
    assert dev.resolve_device(None) == "cpu"
    assert dev.resolve_device("cpu") == "cpu"
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="no CUDA device"):
            dev.resolve_device(spec)


def test_auto_is_the_current_gpu(monkeypatch):
    fake_cuda(monkeypatch, 2, current=1)
    assert dev.resolve_device("auto") == "cuda:1"
    assert dev.resolve_device("cuda") == "cuda:1"
    assert dev.resolve_device("CUDA:0") == "cuda:0"
    assert dev.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="sees 2 CUDA"):
        dev.resolve_device("cuda:2")
    with pytest.raises(ValueError, match="integer"):
        dev.resolve_device("cuda:x")
    with pytest.raises(ValueError, match="expected"):
        dev.resolve_device("tpu")


def test_a_gpu_uuid_maps_to_this_process_index(monkeypatch):
    fake_cuda(monkeypatch, 2)
    import pagedserve.pool_share.cuda_ipc as ipc

    monkeypatch.setattr(ipc, "gpu_uuids", lambda: ["GPU-aaaa", "GPU-bbbb"])
    assert dev.resolve_device("GPU-BBBB") == "cuda:1"
    with pytest.raises(LookupError):
        dev.resolve_device("GPU-cccc")


def test_dtype_auto():
    assert dev.resolve_dtype("auto", "cpu") == "float32"
    assert dev.resolve_dtype(None, "cpu") == "float32"
    assert dev.resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert dev.resolve_dtype("float16", "cuda:3") == "float16"
    assert dev.resolve_dtype("float32", "cuda:0") == "float32"
    with pytest.raises(ValueError):
        dev.resolve_dtype("int8", "cpu")


def test_on_device_selects_the_pools_gpu_and_nothing_on_the_cpu(monkeypatch):
    chosen, synced = [], []

    class FakeGuard:
        def __init__(self, index):
            chosen.append(index)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", FakeGuard)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: synced.append(index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with dev.on_device("cpu"):
        pass
    with dev.on_device(torch.device("cuda", 3)):
        pass
    with dev.on_device("cuda"):
        pass
    dev.synchronize("cpu")
    dev.synchronize("cuda:2")
    assert chosen == [3, 0]
    assert synced == [2]  # never a bare synchronize() (a context on GPU 0)
