"""The pool epoch over gRPC, in one process: memsvc names its pool in RegisterExecutor and
every Reserve answer, the gateway's batch carries it, and the executor refuses a batch
reserved in another pool (ABORTED) and runs one that names none."""
import dataclasses
from concurrent import futures

import grpc
import pytest

from pagedserve.executor.pool_register import register
from pagedserve.executor.server import ExecutorService
from pagedserve.gateway.remote import RemoteExecutorClient, RemoteMemoryClient
from pagedserve.gateway.scheduler import Scheduler
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.sequence import Sequence
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.memsvc.server import MemoryService
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.v1 import executor_pb2_grpc, memory_pb2_grpc
from tests.support.fake_executor import FakeExecutor


@pytest.fixture
def services():
    manager = MemoryManager(MemoryConfig(num_blocks=32))
    memsvc = MemoryService(manager)
    fake = FakeExecutor(block_size=4)
    executor = ExecutorService()
    servers = []
    for add, servicer in ((memory_pb2_grpc.add_MemoryManagerServicer_to_server, memsvc),
                          (executor_pb2_grpc.add_ExecutorServicer_to_server, executor)):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, f"127.0.0.1:{port}"))
    (_, mem_addr), (_, ex_addr) = servers
    handle, epoch = register(mem_addr, fake.info, "cpu", 30.0)
    fake.attach_pool(manager.pool)
    executor.set_ready(fake, fake.info, {}, epoch)
    memory = RemoteMemoryClient(mem_addr, heartbeat_s=0)
    remote = RemoteExecutorClient(ex_addr, timeout=30.0)
    yield manager, epoch, memory, remote
    memory.close()
    remote.close()
    for server, _ in servers:
        server.stop(0)
    memsvc.close()


def test_the_epoch_travels_from_reserve_to_execute(services):
    manager, epoch, memory, executor = services
    assert epoch == manager.pool_epoch
    scheduler = Scheduler(SchedulerConfig(), [999])
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    scheduler.add(Sequence("r/0", "r", 0, [1, 2, 3, 4, 5], sampling, 0, 16, 0.0))
    result = memory.reserve(scheduler.plan()).result()
    assert result.pool_epoch == epoch
    batch, _ = scheduler.on_reserved(result)
    assert batch.pool_epoch == epoch
    assert len(executor.step(batch).result()) == 1

    with pytest.raises(grpc.RpcError) as refused:
        executor.step(dataclasses.replace(batch, pool_epoch="another-pool")).result()
    assert refused.value.code() == grpc.StatusCode.ABORTED
    assert len(executor.step(dataclasses.replace(batch, pool_epoch="")).result()) == 1  # no epoch: not checked
