"""The wire contract: the bottom layer every service imports and that imports no service.

Protocol dataclasses (`protocol`), their protobuf conversions (`convert`), the generated
stubs of `pagedserve.v1` (`v1`), prefix-cache block keys (`block_keys`), the pool-sharing
handles (`shm_pool` on a CPU, `cuda_ipc` on a GPU), and the gRPC, TLS, tracing and metrics
helpers each service uses the same way.
"""
