"""The KV pool shared between processes: POSIX shared memory on a CPU, CUDA IPC on a GPU,
and the devices they live on. Above pagedserve.wire, below everything else
(docs/ARCHITECTURE.md).
"""
