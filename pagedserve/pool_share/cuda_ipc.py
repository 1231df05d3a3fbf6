"""The GPU KV pool: one device allocation in memsvc, mapped by the executor via CUDA IPC.

It uses torch's public CUDA IPC path (`torch.multiprocessing.reductions.reduce_tensor` on
the producer, `rebuild_cuda_tensor` on the consumer, the same calls torch.multiprocessing
makes). It ran on an H200 (scripts/gpu_check.sh's services part: greedy, n=4, beam search,
an executor SIGKILLed and restarted on the same pool, swap: docs/benchmark-history.md, "On one H200");
the suite, without a GPU, covers everything up to the CUDA boundary (handle packing, UUID
selection).

Contract:
- The GPU is named by its physical UUID ("GPU-xxxxxxxx-..."), never by an index: indices
  depend on CUDA_VISIBLE_DEVICES, which may differ between memsvc and the executor. Each
  side maps the UUID to its own device index (`device_index_for_uuid`).
- memsvc allocates the pool (`allocate_cuda_pool`), keeps it alive for its lifetime and
  sends the packed `CudaIpcHandle` in PoolHandle.cuda_ipc_handle; the executor calls
  `attach_cuda_pool(CudaIpcHandle.unpack(data))` and gets a tensor over the same memory.
- Both processes must run as the same user on the same host; the allocation is freed when
  memsvc exits (an executor that outlives it must not touch the pool again).
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import asdict, dataclass

import torch

from pagedserve.wire.protocol import KVGeometry


def normalize_uuid(uuid: str) -> str:
    """'GPU-6BD8...' and '6bd8...' name the same GPU; compare in this form (lower, no prefix)."""
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def gpu_uuids() -> list[str]:
    """UUIDs of the visible CUDA devices, by device index, as 'GPU-<uuid>'."""
    return [f"GPU-{normalize_uuid(torch.cuda.get_device_properties(i).uuid)}"
            for i in range(torch.cuda.device_count())]


def device_index_for_uuid(uuid: str, uuids: list[str] | None = None) -> int:
    """This process's device index of the GPU with this UUID; LookupError if it is not visible."""
    uuids = gpu_uuids() if uuids is None else uuids
    want = normalize_uuid(uuid)
    for index, candidate in enumerate(uuids):
        if normalize_uuid(candidate) == want:
            return index
    raise LookupError(f"GPU {uuid} is not visible to this process (visible: {uuids or 'none'}); "
                      "check CUDA_VISIBLE_DEVICES")


def is_gpu_uuid(device: str) -> bool:
    return device.upper().startswith(("GPU-", "MIG-"))


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


_BYTES_FIELDS = ("storage_handle", "ref_counter_handle", "event_handle")


@dataclass
class CudaIpcHandle:
    """What the executor needs to map the pool: torch's IPC arguments plus the GPU UUID."""

    gpu_uuid: str
    shape: list[int]
    stride: list[int]
    tensor_offset: int
    dtype: str
    storage_handle: bytes  # cudaIpcMemHandle_t of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # of the storage inside that allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def pack(self) -> bytes:
        d = asdict(self)
        for name in _BYTES_FIELDS:
            d[name] = _b64(d[name])
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def unpack(cls, data: bytes) -> CudaIpcHandle:
        try:
            d = json.loads(data)
            for name in _BYTES_FIELDS:
                d[name] = _unb64(d[name])
            return cls(**d)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not a pagedserve CUDA IPC handle: {e}") from None


def export_cuda_tensor(tensor: torch.Tensor, gpu_uuid: str) -> CudaIpcHandle:
    """Describe a CUDA tensor for another process (the producer keeps `tensor` alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, dtype, _, handle, size_bytes, offset_bytes, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaIpcHandle(
        gpu_uuid=gpu_uuid, shape=list(size), stride=list(stride), tensor_offset=int(offset),
        dtype=str(dtype).removeprefix("torch."), storage_handle=bytes(handle),
        storage_size_bytes=int(size_bytes), storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync),
    )


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def check_allocator_config(env=None) -> None:
    """RuntimeError where torch's allocator is set to expandable segments: it then maps
    memory another way than the one these IPC handles export and rebuild."""
    env = os.environ if env is None else env
    for var in ALLOC_CONF_VARS:
        options = dict(o.split(":", 1) for o in env.get(var, "").replace(" ", "").split(",") if ":" in o)
        if options.get("expandable_segments", "").lower() in ("true", "1"):
            raise RuntimeError(f"{var} sets expandable_segments:{options['expandable_segments']}: the KV "
                               "pool is shared with the executor through CUDA IPC handles, which torch "
                               "does not give for expandable segments; unset it (or set "
                               "expandable_segments:False) for memsvc")


def allocate_cuda_pool(geometry: KVGeometry, num_blocks: int, gpu_uuid: str
                       ) -> tuple[torch.Tensor, CudaIpcHandle]:
    """A zeroed pool on the GPU with this UUID, and the handle that exports it. Every CUDA
    call runs with that GPU current (no context is created on another GPU), and the zeroing
    is complete before the handle exists. RuntimeError first where torch's allocator is set
    to expandable segments (`check_allocator_config`)."""
    from pagedserve.pool_share.device import on_device

    check_allocator_config()
    index = device_index_for_uuid(gpu_uuid)
    device = torch.device("cuda", index)
    with on_device(device):
        pool = torch.zeros(geometry.pool_shape(num_blocks), dtype=getattr(torch, geometry.dtype),
                           device=device)
        torch.cuda.synchronize(device)
        return pool, export_cuda_tensor(pool, gpu_uuid)


def attach_cuda_pool(handle: CudaIpcHandle) -> torch.Tensor:
    """Map the pool memsvc exported, on this process's index of the handle's GPU (made
    current for the mapping, which also waits on memsvc's IPC event when it sent one)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from pagedserve.pool_share.device import on_device

    index = device_index_for_uuid(handle.gpu_uuid)
    with on_device(torch.device("cuda", index)):
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle.shape), tuple(handle.stride), handle.tensor_offset,
            torch.UntypedStorage, getattr(torch, handle.dtype), index, handle.storage_handle,
            handle.storage_size_bytes, handle.storage_offset_bytes, False,
            handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
            handle.event_sync_required,
        )
