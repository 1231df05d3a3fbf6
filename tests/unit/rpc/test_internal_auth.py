"""pagedserve.rpc.internal_auth on a real in-process gRPC server: a call without the token, or with
another, is UNAUTHENTICATED (unary and streaming, before the servicer runs); with it, it
runs; health stays open; open_channel adds the token; a service with neither token nor
mutual TLS refuses to start unless told it may."""
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.rpc import internal_auth
from pagedserve.rpc.grpc_service import Service, open_channel
from pagedserve.rpc.tls import TlsConfig
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc

TOKEN = "t0ken-for-the-unit-tests-0123456789"


class Memory(memory_pb2_grpc.MemoryManagerServicer):
    def __init__(self):
        self.calls = []

    def Stats(self, request, context):
        self.calls.append("Stats")
        return memory_pb2.StatsResponse(num_sequences=7)

    def WatchBlocks(self, request, context):
        self.calls.append("WatchBlocks")
        yield memory_pb2.BlockEvents(snapshot=True)


@pytest.fixture(scope="module")
def served():
    servicer = Memory()
    service = Service(["pagedserve.v1.MemoryManager"], interceptors=internal_auth.interceptors(TOKEN))
    memory_pb2_grpc.add_MemoryManagerServicer_to_server(servicer, service.server)
    address = service.start("127.0.0.1", 0)
    service.set_serving(True)
    yield address, servicer
    service.stop(0)


def status_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.UNAUTHENTICATED or "--internal-token" in e.details()
        return e.code()
    return grpc.StatusCode.OK


def calls(channel):
    stub = memory_pb2_grpc.MemoryManagerStub(channel)
    return (lambda: stub.Stats(memory_pb2.StatsRequest(), timeout=5),
            lambda: list(stub.WatchBlocks(memory_pb2.WatchBlocksRequest(), timeout=5)))


@pytest.mark.parametrize("token", [None, "another-token-of-enough-length"])
def test_a_call_without_the_token_or_with_another_is_refused_before_the_servicer(served, token):
    address, servicer = served
    servicer.calls.clear()
    with open_channel(address, token=token) as channel:
        unary, stream = calls(channel)
        assert status_of(unary) == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(stream) == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.calls == []


def test_a_call_with_the_token_runs(served):
    address, servicer = served
    servicer.calls.clear()
    with open_channel(address, token=TOKEN) as channel:
        stub = memory_pb2_grpc.MemoryManagerStub(channel)
        assert stub.Stats(memory_pb2.StatsRequest(), timeout=5).num_sequences == 7
        assert stub.Stats.future(memory_pb2.StatsRequest(), timeout=5,  # other metadata kept
                                 metadata=[("traceparent", "x")]).result().num_sequences == 7
        assert [e.snapshot for e in stub.WatchBlocks(memory_pb2.WatchBlocksRequest(), timeout=5)] == [True]
    assert servicer.calls == ["Stats", "Stats", "WatchBlocks"]


def test_health_stays_open(served):
    address, _ = served
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_no_token_no_check():
    assert internal_auth.interceptors(None) == [] and internal_auth.interceptors("") == []


@pytest.mark.parametrize("token,words", [("short", "at least 16"), ("has a space in it, long", "printable"),
                                         ("ünïcode-token-of-length", "printable")])
def test_a_token_that_cannot_be_one_names_the_setting(token, words):
    with pytest.raises(ValueError, match=words) as e:
        internal_auth.check_token(token)
    assert "--internal-token" in str(e.value)
    internal_auth.check_token(internal_auth.new_token())
    assert internal_auth.new_token() != internal_auth.new_token()


def test_a_service_with_neither_token_nor_mutual_tls_refuses_to_start(caplog):
    with pytest.raises(ValueError, match="--internal-token.*--insecure-internal") as e:
        internal_auth.require_closed("memsvc", None, TlsConfig(), insecure=False)
    assert str(e.value).startswith("memsvc ")
    with pytest.raises(ValueError):  # TLS without a CA checks no caller
        internal_auth.require_closed("memsvc", None, TlsConfig(cert="c", key="k"), insecure=False)
    internal_auth.require_closed("memsvc", TOKEN, TlsConfig(), insecure=False)
    internal_auth.require_closed("memsvc", None, TlsConfig(cert="c", key="k", ca="ca"), insecure=False)
    log = logging.getLogger("test-internal-auth")
    with caplog.at_level(logging.WARNING, logger="test-internal-auth"):
        internal_auth.require_closed("memsvc", None, TlsConfig(), insecure=True, log=log)
    assert "--insecure-internal" in caplog.text
