"""The executor's side of the pool handshake: register with memsvc (its geometry, device, the
budget for the pool) and map the pool memsvc answers with (shared memory on a CPU, CUDA IPC on
a GPU; a tensor-parallel group's pools per rank). See docs/ARCHITECTURE.md, "The pool and how
it is shared".
"""
from __future__ import annotations

import grpc

from pagedserve.rpc.grpc_service import open_channel
from pagedserve.wire import convert
from pagedserve.wire.protocol import ModelInfo
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc


def register(memsvc: str, info: ModelInfo, device: str, timeout: float, tls=None, ranks: int = 1,
             holds_pool: list[bool] | None = None, token: str | None = None, budget_bytes: int = 0
             ) -> tuple[memory_pb2.PoolHandle, str | None]:
    """RegisterExecutor at memsvc (with the internal `token`), waiting up to `timeout`
    seconds for it to answer (a tensor-parallel group: one pool per rank, each on `device`,
    but for the ranks that `holds_pool` themselves: pagedserve.executor.tp_pools).
    `budget_bytes`: the pool's size where memsvc is given none (0: memsvc's default).
    Returns the pool handle and the pool's epoch (None from a memsvc that sends none)."""
    with open_channel(memsvc, tls, token) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        response = memory_pb2_grpc.MemoryManagerStub(channel).RegisterExecutor(
            memory_pb2.RegisterExecutorRequest(geometry=convert.geometry_to_proto(info.kv),
                                               device=device, max_model_len=info.max_model_len,
                                               budget_bytes=budget_bytes,
                                               rank_devices=[device] * ranks if ranks > 1 else [],
                                               rank_holds_pool=holds_pool if any(holds_pool or ()) else []),
            timeout=timeout, wait_for_ready=True)
    return response.pool, response.pool_epoch or None


def map_pool(handle: memory_pb2.PoolHandle):
    """The pool tensor described by memsvc's PoolHandle, mapped into this process; a
    tensor-parallel group's: rank 0's mapped, then each other rank's (name, shape, dtype),
    which that rank maps, or allocates where the name is "" (pagedserve.executor.tp_pools.own_pool)."""
    kind = handle.WhichOneof("handle")
    if kind == "shm_name":
        from pagedserve.pool_share.shm_pool import attach_shm_pool

        pool = attach_shm_pool(handle.shm_name, list(handle.shape), handle.dtype)
        if len(handle.rank_shm_names) > 1:
            return [pool, *[(name, list(handle.shape), handle.dtype) for name in handle.rank_shm_names[1:]]]
        return pool
    if kind == "cuda_ipc_handle":
        from pagedserve.pool_share.cuda_ipc import CudaIpcHandle, attach_cuda_pool

        return attach_cuda_pool(CudaIpcHandle.unpack(handle.cuda_ipc_handle))
    raise ValueError("memsvc sent a pool handle with neither shm_name nor cuda_ipc_handle")
