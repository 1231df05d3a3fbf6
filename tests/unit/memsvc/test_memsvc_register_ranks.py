"""memsvc's RegisterExecutor for a tensor-parallel group (issue 29): `rank_devices` says how many
ranks; the answer names one shared-memory segment per rank (`rank_shm_names`, rank 0's also
`shm_name`) whose shape holds one rank's KV heads; devices of different kinds, or KV heads
that do not split over the ranks, are refused naming the field."""
import grpc
import pytest

from pagedserve.memsvc.config import MemoryConfig
from pagedserve.memsvc.memory_manager import MemoryManager
from pagedserve.memsvc.server import MemoryService
from pagedserve.wire import convert
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.v1 import memory_pb2
from tests.support.servicer_context import Aborted, Context

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=4, head_size=8, block_size=4)


@pytest.fixture
def service():
    s = MemoryService(MemoryManager(MemoryConfig(num_blocks=8, shared=True, max_model_len=64,
                                                 preemption_mode="recompute")))
    yield s
    s.close()


def register(service, devices, geometry=GEOMETRY):
    return service.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
        geometry=convert.geometry_to_proto(geometry), device="cpu", rank_devices=devices), Context())


def test_one_segment_per_rank(service):
    handle = register(service, ["cpu", "cpu"]).pool
    assert len(handle.rank_shm_names) == 2 and handle.rank_shm_names[0] == handle.shm_name
    assert list(handle.shape) == [8, 2, 2, 4, 2, 8]  # 2 of the group's 4 KV heads each
    again = register(service, ["cpu", "cpu"]).pool  # a restarted group: the same segments
    assert list(again.rank_shm_names) == list(handle.rank_shm_names)


@pytest.mark.parametrize("devices, code, words", [
    (["cpu", "GPU-1234"], grpc.StatusCode.INVALID_ARGUMENT, "rank_devices"),
    (["cpu"] * 3, grpc.StatusCode.FAILED_PRECONDITION, "num_kv_heads (4) is not a multiple of the 3 ranks"),
])
def test_refusals_name_the_field(service, devices, code, words):
    context = Context()
    with pytest.raises(Aborted):
        service.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
            geometry=convert.geometry_to_proto(GEOMETRY), device="cpu", rank_devices=devices), context)
    assert context.code == code and words in context.details
