"""pagedserve.rpc.step_channel (its server and client modules): frames carry the servicer's answers and its errors as gRPC would."""
import socket
import threading

import grpc
import pytest

from pagedserve.rpc import step_channel, step_channel_client
from pagedserve.rpc.step_channel import StepChannelError
from pagedserve.rpc.step_channel_client import StepChannelSlot, host_of
from pagedserve.rpc.step_channel_server import StepChannelServer
from pagedserve.wire.v1 import memory_pb2


def _reserve(request, context):
    if request.session_id == "bad":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session bad")
    if request.session_id == "boom":
        raise RuntimeError("handler broke")
    if request.session_id == "slow":
        _release.wait(5)
    return memory_pb2.ReserveResponse(pool_epoch=f"{request.session_id}@{context.peer()[:12]}",
                                      grant_seq_ids=list(request.free))


_release = threading.Event()


@pytest.fixture
def server():
    s = StepChannelServer("127.0.0.1", {"Reserve": (_reserve, memory_pb2.ReserveRequest)})
    yield s
    s.close()


def _client(server):
    slot = StepChannelSlot(f"127.0.0.1:{server.port}")
    slot.offer(server.port)
    assert slot.get() is not None
    return slot


def test_answers_and_errors_as_grpc_would(server):
    slot = _client(server)
    c = slot.get()
    r = c.call("Reserve", memory_pb2.ReserveRequest(session_id="g", free=["a", "b"]), memory_pb2.ReserveResponse, 5)
    assert r.pool_epoch == "g@step-channel" and list(r.grant_seq_ids) == ["a", "b"]
    with pytest.raises(grpc.RpcError) as e:
        c.call("Reserve", memory_pb2.ReserveRequest(session_id="bad"), memory_pb2.ReserveResponse, 5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "session bad"
    with pytest.raises(StepChannelError) as e:
        c.call("Reserve", memory_pb2.ReserveRequest(session_id="boom"), memory_pb2.ReserveResponse, 5)
    assert e.value.code() == grpc.StatusCode.UNKNOWN and "handler broke" in e.value.details()
    with pytest.raises(StepChannelError) as e:
        c.call("Execute", memory_pb2.ReserveRequest(), memory_pb2.ReserveResponse, 5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert c.alive  # errors leave the connection up
    slot.close()


def _call_in_thread(client, session_id: str) -> tuple[threading.Thread, list]:
    """A Reserve call on its own thread; its answer lands in the list."""
    out = []
    t = threading.Thread(target=lambda: out.append(
        client.call("Reserve", memory_pb2.ReserveRequest(session_id=session_id), memory_pb2.ReserveResponse, 5)))
    t.start()
    return t, out


def test_a_second_call_runs_while_the_first_waits(server):
    _release.clear()
    c = _client(server).get()
    t, out = _call_in_thread(c, "slow")
    fast = c.call("Reserve", memory_pb2.ReserveRequest(session_id="fast"), memory_pb2.ReserveResponse, 5)
    assert fast.pool_epoch.startswith("fast@") and not out
    _release.set()
    t.join(5)
    assert out[0].pool_epoch.startswith("slow@")


def test_an_inline_method_answers_a_connections_calls_in_order_on_its_thread():
    threads = []

    def reserve(request, context):
        threads.append(threading.current_thread().name)
        return _reserve(request, context)

    s = StepChannelServer("127.0.0.1", {"Reserve": (reserve, memory_pb2.ReserveRequest)}, inline=("Reserve",))
    try:
        _release.clear()
        c = _client(s).get()
        t, out = _call_in_thread(c, "slow")
        t2, second = _call_in_thread(c, "fast")
        t2.join(0.3)
        assert not second  # behind the first on its connection
        _release.set()
        t.join(5)
        t2.join(5)
        assert out[0].pool_epoch.startswith("slow@") and second[0].pool_epoch.startswith("fast@")
        assert set(threads) == {"step-channel-conn"}
        with pytest.raises(grpc.RpcError) as e:
            c.call("Reserve", memory_pb2.ReserveRequest(session_id="bad"), memory_pb2.ReserveResponse, 5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and c.alive
    finally:
        _release.set()
        s.close()


def test_a_closed_server_fails_calls_in_flight_and_the_slot_drops_it(server):
    _release.clear()
    slot = _client(server)
    c = slot.get()
    errors = []

    def call():
        try:
            c.call("Reserve", memory_pb2.ReserveRequest(session_id="slow"), memory_pb2.ReserveResponse, 5)
        except StepChannelError as e:
            errors.append(e.code())

    t = threading.Thread(target=call)
    t.start()
    server.close()
    t.join(5)
    _release.set()
    assert errors == [grpc.StatusCode.UNAVAILABLE]
    assert slot.get() is None  # the next call goes over gRPC
    with pytest.raises(StepChannelError) as e:
        c.call("Reserve", memory_pb2.ReserveRequest(session_id="g"), memory_pb2.ReserveResponse, 5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_unreachable_port_is_not_tried_again():
    s = StepChannelServer("127.0.0.1", {})
    port = s.port
    s.close()
    slot = StepChannelSlot(f"127.0.0.1:{port}")
    slot.offer(port)
    assert slot.get() is None and port in slot._refused


def test_host_of():
    assert host_of("127.0.0.1:50051") == "127.0.0.1"
    assert host_of("[::1]:50051") == "::1"
    assert host_of("unix:/tmp/x") is None and host_of("dns:///svc:1") is None
    assert StepChannelSlot("127.0.0.1:1", enabled=False).host is None


def test_the_slot_goes_over_grpc_until_an_answer_offers_the_channel(server):
    grpc_calls = []

    def over_grpc(request, timeout, metadata):
        grpc_calls.append(request.session_id)
        return memory_pb2.ReserveResponse(pool_epoch="grpc", step_port=server.port)

    slot = StepChannelSlot(f"127.0.0.1:{server.port}")
    first = slot.call("Reserve", over_grpc, memory_pb2.ReserveRequest(session_id="a"), memory_pb2.ReserveResponse, 5)
    second = slot.call("Reserve", over_grpc, memory_pb2.ReserveRequest(session_id="b"), memory_pb2.ReserveResponse, 5)
    assert first.pool_epoch == "grpc" and second.pool_epoch.startswith("b@step-channel")
    assert grpc_calls == ["a"]
    client = slot.get()
    server.close()
    with pytest.raises(StepChannelError):  # in flight or next: UNAVAILABLE, then gRPC again
        for _ in range(50):
            client.call("Reserve", memory_pb2.ReserveRequest(session_id="c"), memory_pb2.ReserveResponse, 5)
    third = slot.call("Reserve", over_grpc, memory_pb2.ReserveRequest(session_id="d"), memory_pb2.ReserveResponse, 5)
    assert third.pool_epoch == "grpc" and grpc_calls == ["a", "d"]


def test_answers_are_read_by_the_thread_that_waits_and_kept_for_others(server, monkeypatch):
    readers = []
    read = step_channel.read_frame

    def recorded(sock):
        frame = read(sock)
        readers.append(threading.current_thread().name)
        return frame

    monkeypatch.setattr(step_channel_client, "read_frame", recorded)
    _release.clear()
    c = _client(server).get()
    request = memory_pb2.ReserveRequest
    slow = c.send("Reserve", request(session_id="slow"))
    fast = c.send("Reserve", request(session_id="fast"))
    assert c.answer(fast, "Reserve", memory_pb2.ReserveResponse, 5).pool_epoch.startswith("fast@")
    _release.set()
    assert c.answer(slow, "Reserve", memory_pb2.ReserveResponse, 5).pool_epoch.startswith("slow@")
    me = threading.current_thread().name
    assert [r for r in readers if not r.startswith("step-channel")] == [me, me]  # the server's aside


def test_a_waiter_gets_its_answer_when_another_thread_reads_it(server):
    _release.clear()
    c = _client(server).get()
    t, out = _call_in_thread(c, "slow")  # this thread reads, waiting for the slow answer
    fast = c.call("Reserve", memory_pb2.ReserveRequest(session_id="fast"), memory_pb2.ReserveResponse, 5)
    assert fast.pool_epoch.startswith("fast@") and not out
    _release.set()
    t.join(5)
    assert out[0].pool_epoch.startswith("slow@")


def test_no_answer_in_time_leaves_the_channel_whole(server):
    _release.clear()
    c = _client(server).get()
    slow = c.send("Reserve", memory_pb2.ReserveRequest(session_id="slow"))
    with pytest.raises(StepChannelError) as e:
        c.answer(slow, "Reserve", memory_pb2.ReserveResponse, 0.2)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _release.set()
    # the late answer is dropped; the next call is answered as usual
    r = c.call("Reserve", memory_pb2.ReserveRequest(session_id="g", free=["x"]), memory_pb2.ReserveResponse, 5)
    assert r.pool_epoch.startswith("g@") and list(r.grant_seq_ids) == ["x"] and c.alive


def test_the_slot_starts_a_call_and_its_answer_is_read_later(server):
    slot = _client(server)
    answer = slot.start("Reserve", None, memory_pb2.ReserveRequest(session_id="a"), memory_pb2.ReserveResponse, 5)
    assert answer().pool_epoch.startswith("a@")
    server.close()

    def over_grpc(request, timeout, metadata):
        raise StepChannelError(grpc.StatusCode.UNAVAILABLE, "no gRPC server here")

    failed = [slot.start("Reserve", over_grpc, memory_pb2.ReserveRequest(session_id="b"),
                         memory_pb2.ReserveResponse, 5) for _ in range(3)]
    with pytest.raises(StepChannelError):
        for answer in failed:
            answer()



TOKEN = "step-channel-token-0123456789"


@pytest.fixture
def closed_server():
    calls = []

    def reserve(request, context):
        calls.append(request.session_id)
        return _reserve(request, context)

    s = StepChannelServer("127.0.0.1", {"Reserve": (reserve, memory_pb2.ReserveRequest)}, token=TOKEN)
    s.calls = calls
    yield s
    s.close()


def test_a_connection_whose_hello_carries_the_token_is_served(closed_server):
    slot = StepChannelSlot(f"127.0.0.1:{closed_server.port}", token=TOKEN)
    slot.offer(closed_server.port)
    r = slot.get().call("Reserve", memory_pb2.ReserveRequest(session_id="g"), memory_pb2.ReserveResponse, 5)
    assert r.pool_epoch.startswith("g@") and closed_server.calls == ["g"]
    slot.close()


@pytest.mark.parametrize("token", [None, "another-token-0123456789"])
def test_a_hello_without_the_token_is_refused_and_not_tried_again(closed_server, token):
    slot = StepChannelSlot(f"127.0.0.1:{closed_server.port}", token=token)
    slot.offer(closed_server.port)
    assert slot.get() is None and closed_server.port in slot._refused
    with pytest.raises(StepChannelError) as e:
        step_channel_client.StepChannelClient("127.0.0.1", closed_server.port, token)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--internal-token" in e.value.details()
    assert closed_server.calls == []


def _raw_answer(port: int, frame: bytes) -> tuple[int, bytes, bytes]:
    """Send `frame` on a new connection: (status, details) of the answer and what follows
    it before the server closes the connection (a reset, with the rest of `frame` unread)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(frame)
        status, details = step_channel.read_hello(sock)
        rest = b""
        try:
            while chunk := sock.recv(4096):
                rest += chunk
        except ConnectionResetError:
            pass
    return status, details, rest


def test_a_call_without_a_hello_is_refused_and_the_connection_closed(closed_server):
    payload = memory_pb2.ReserveRequest(session_id="intruder").SerializeToString()
    reserve = step_channel.HEADER.pack(len(payload), 1, step_channel.METHODS["Reserve"]) + payload
    status, details, rest = _raw_answer(closed_server.port, reserve + reserve)
    assert status == grpc.StatusCode.UNAUTHENTICATED.value[0] and b"hello" in details
    assert rest == b"" and closed_server.calls == []
    hello = step_channel.HEADER.pack(len(TOKEN), 0, step_channel.HELLO) + TOKEN.encode()
    status, _, rest = _raw_answer(closed_server.port, hello[:-1] + b"X" + reserve)  # a wrong token
    assert status == grpc.StatusCode.UNAUTHENTICATED.value[0] and rest == b""
    assert closed_server.calls == []
