"""The gRPC executor client's half of the step message (pagedserve.gateway.remote): each sequence's
state goes once, steps are encoded in their order even when a later one is handed over
first, and after a failure everything goes again. The stub is faked: no server runs."""
import threading
import time

import grpc
import pytest

from pagedserve.gateway.remote import RemoteExecutorClient
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.step_delta import StepDelta
from pagedserve.wire.v1 import executor_pb2


MEMSVC: dict = {}  # seq id -> its Seq, whose `block_table` stands for memsvc's table of it


class Seq:
    sampling, seed = SamplingParams(temperature=0.0), 1

    def __init__(self, prompt, table, seq_id="a"):
        self.prompt_token_ids, self.output_token_ids, self.block_table = prompt, [], table
        MEMSVC[seq_id] = self


def one(seq_id, tokens, start, sample, table_start, new_blocks, seq, step):
    """A step of one sequence."""
    return StepDelta([seq_id], [start], [len(tokens)], list(tokens), [sample], [table_start], [len(new_blocks)],
                     list(new_blocks), [seq], step=step)


class Stub:
    def __init__(self):
        self.requests = []
        self.fail = False

    def Execute(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        if self.fail:
            self.fail = False
            raise Unavailable()
        sampled = len(request.start_pos) if request.decode else sum(request.sample)
        return executor_pb2.ExecuteResponse(tokens=[7] * sampled, incarnation="x1")


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "gone"


@pytest.fixture
def client():
    c = RemoteExecutorClient("127.0.0.1:1")  # never dialled: the stub is replaced
    c.stub = Stub()
    c.tables = lambda ids: [list(MEMSVC[s].block_table) for s in ids]  # memsvc's, asked on a resend
    yield c
    c.channel.close()


def test_state_goes_once_then_only_the_change(client):
    a = Seq([1, 2, 3], [5])
    client.step(one("a", [1, 2, 3], 0, True, 0, [5], a, step=1)).result()
    a.block_table = [5, 6]
    client.step(one("a", [PENDING], 3, True, 1, [6], a, step=2)).result()
    first, second = client.stub.requests
    assert len(first.states) == 1 and list(first.new_blocks) == [5]
    assert not second.states and list(second.table_start) == [1] and list(second.new_blocks) == [6]
    assert second.decode and list(second.fed) == [] and list(second.token_ids) == []


def test_a_later_step_handed_over_first_is_encoded_after_the_earlier_one(client):
    a = Seq([1, 2, 3], [5, 6])
    s1 = one("a", [1, 2, 3], 0, True, 0, [5], a, step=1)
    s2 = one("a", [PENDING], 3, True, 1, [6], a, step=2)
    t = threading.Thread(target=lambda: client.step(s2).result())
    t.start()
    time.sleep(0.05)
    assert client.stub.requests == []  # step 2 waits for step 1's encoding
    client.step(s1).result()
    t.join(5)
    first, second = client.stub.requests
    assert (first.step, len(first.states)) == (1, 1)
    assert (second.step, len(second.states)) == (2, 0)  # a's state went with step 1


def test_until_the_executor_answers_each_step_names_the_first_one_sent(client):
    a = Seq([1, 2, 3], [5, 6])
    first = client.step(one("a", [1, 2, 3], 0, True, 0, [5], a, step=1))
    second = client.step(one("a", [PENDING], 3, True, 1, [6], a, step=2))
    first.result(), second.result()
    client.step(one("a", [PENDING], 4, True, 2, [], a, step=3)).result()
    assert [r.first_step for r in client.stub.requests] == [1, 1, 0]  # then its order holds


def test_after_a_failure_every_state_and_whole_table_goes_again(client):
    a = Seq([1, 2, 3], [5])
    client.step(one("a", [1, 2, 3], 0, True, 0, [5], a, step=1)).result()
    client.stub.fail = True
    a.block_table = [5, 6]
    step = one("a", [4], 3, True, 1, [6], a, step=2)
    with pytest.raises(grpc.RpcError):
        client.step(step).result()
    client.step(step).result()
    again = client.stub.requests[-1]
    assert len(again.states) == 1 and list(again.table_start) == [0] and list(again.new_blocks) == [5, 6]


class Refused(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_step_sent_behind_one_whose_state_was_lost_goes_again_with_every_state(client):
    """A restarted executor refuses step 2 (state lost) before changing anything, so step 3,
    encoded meanwhile as a change only, is refused on a table change it never had: both go
    again with every state; a refusal with no resync in between is the caller's."""
    a = Seq([1, 2, 3], [5])
    client.step(one("a", [1, 2, 3], 0, True, 0, [5], a, step=1)).result()
    stub, refusals = client.stub, {}
    answer = stub.Execute

    def execute(request, timeout=None, metadata=None):
        if (request.step, len(request.states)) in refusals:
            stub.requests.append(request)
            raise refusals.pop((request.step, len(request.states)))
        return answer(request, timeout, metadata)

    stub.Execute = execute
    refusals[(2, 0)] = Refused(grpc.StatusCode.FAILED_PRECONDITION, "executor state lost: send every state")
    refusals[(3, 0)] = Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               "batch rejected: sequence a: block table change at 2, but it holds 1 blocks")
    a.block_table = [5, 6]
    later2 = client.step(one("a", [PENDING], 3, True, 1, [6], a, step=2))
    a.block_table = [5, 6, 7]
    later3 = client.step(one("a", [PENDING], 4, True, 2, [7], a, step=3))
    assert len(later2.result()) == 1 and len(later3.result()) == 1
    sent = [(r.step, len(r.states), list(r.table_start)) for r in stub.requests[1:]]
    assert sent == [(2, 0, [1]), (3, 0, [2]), (2, 1, [0]), (3, 1, [0])]
    assert client.num_resyncs == 2
    refusals[(4, 0)] = Refused(grpc.StatusCode.INVALID_ARGUMENT, "batch rejected: bad")
    with pytest.raises(grpc.RpcError):  # nothing was sent again meanwhile: not retried
        client.step(one("a", [PENDING], 5, True, 3, [], a, step=4)).result()
    assert client.num_resyncs == 2
