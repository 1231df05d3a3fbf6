"""CUDA IPC up to the boundary: handle packing and GPU selection by UUID (no GPU needed).

attach/allocate themselves need a GPU and are not exercised here.
"""
import pytest

from pagedserve.pool_share.cuda_ipc import CudaIpcHandle, device_index_for_uuid, is_gpu_uuid, normalize_uuid

UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-6bd8ba5b-aaaa-bbbb-cccc-0123456789ab"]


def test_handle_round_trips_through_bytes():
    h = CudaIpcHandle(
        gpu_uuid=UUIDS[1], shape=[10, 30, 2, 16, 3, 64], stride=[184320, 6144, 3072, 192, 64, 1],
        tensor_offset=0, dtype="bfloat16", storage_handle=bytes(range(64)),
        storage_size_bytes=3686400, storage_offset_bytes=512, ref_counter_handle=b"/torch_1_2",
        ref_counter_offset=8, event_handle=b"\x00\xff" * 32, event_sync_required=True,
    )
    data = h.pack()
    assert isinstance(data, bytes)
    assert CudaIpcHandle.unpack(data) == h
    h.event_handle = None
    assert CudaIpcHandle.unpack(h.pack()) == h


def test_garbage_is_not_a_handle():
    for data in (b"", b"{}", b"\x00\x01", b'{"gpu_uuid": "x"}'):
        with pytest.raises(ValueError, match="CUDA IPC handle"):
            CudaIpcHandle.unpack(data)


def test_uuid_selects_the_local_index_whatever_the_spelling():
    assert device_index_for_uuid(UUIDS[1], UUIDS) == 1
    assert device_index_for_uuid("6BD8BA5B-AAAA-BBBB-CCCC-0123456789AB", UUIDS) == 1
    assert device_index_for_uuid(UUIDS[0].lower(), list(reversed(UUIDS))) == 1
    with pytest.raises(LookupError, match="CUDA_VISIBLE_DEVICES"):
        device_index_for_uuid("GPU-00000000-0000-0000-0000-000000000000", UUIDS)
    with pytest.raises(LookupError):
        device_index_for_uuid(UUIDS[0], [])
    assert normalize_uuid(" GPU-AbC ") == "abc"


def test_devices_named_by_uuid_are_gpus():
    assert is_gpu_uuid(UUIDS[0]) and is_gpu_uuid("MIG-abc")
    assert not is_gpu_uuid("cpu") and not is_gpu_uuid("cuda:0")


def test_the_executor_names_its_gpu_to_memsvc_by_uuid(monkeypatch):
    import pagedserve.pool_share.cuda_ipc
    from pagedserve.executor.server import resolve_device

    import torch

    monkeypatch.setattr(pagedserve.pool_share.cuda_ipc, "gpu_uuids", lambda: list(UUIDS))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(UUIDS))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cpu") == ("cpu", "cpu")
    assert resolve_device("cuda:1") == ("cuda:1", UUIDS[1])
    assert resolve_device("cuda") == ("cuda:0", UUIDS[0])
    assert resolve_device(UUIDS[1].lower()) == ("cuda:1", UUIDS[1].lower())


def test_expandable_segments_are_refused_before_any_cuda_call():
    from pagedserve.pool_share.cuda_ipc import check_allocator_config

    for env in ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:1"}):
        with pytest.raises(RuntimeError, match="expandable_segments"):
            check_allocator_config(env)
    check_allocator_config({})
    check_allocator_config({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:64"})
