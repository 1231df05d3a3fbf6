"""pagedserve.executor.tp_broadcast: a tensor-parallel command travels as protobuf in two tensors (its
length, its bytes) and comes back equal, floats not rounded (1e-46 is 0 as a float32); nothing
is pickled; a command too big is refused before anything is sent."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.executor import tp_broadcast
from pagedserve.step.step_batch import FLAG_INVALID, Held, StepBatch
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SamplingParams
from tests.support.step_batches import assert_same_batch

EXECUTOR = Path(tp_broadcast.__file__).resolve().parent


def batch() -> StepBatch:
    guided = SamplingParams(max_tokens=7, temperature=0.1234567891, top_p=0.75, top_k=20, min_p=1e-46,
                            repetition_penalty=1.25, presence_penalty=-0.3, frequency_penalty=0.2,
                            seed=3, stop=["\n"], stop_token_ids=[2], ignore_eos=True, logprobs=4,
                            prompt_logprobs=0, guided_kind="regex", guided_spec="a+", min_tokens=3,
                            logit_bias={5: -100.0, 2**32 - 1: 0.1234567891})
    beam = SamplingParams(temperature=0.0, presence_penalty=0.5, n=2, beam_width=2, length_penalty=0.7,
                          early_stopping=True)  # beam search takes no prompt_logprobs: another row
    b = batch_of([
        Seq("s/0", [11, 12, 13], 0, [4, 9], True, guided, 2**63 + 5, prompt=[11, 12, 13, 14]),
        Seq("s/1", [8], 3, [0, 0, 18], False, beam, 0,
            prompt=[1, 2], output=[7, 8]),
        Seq("s/2", [-1], 4, [5], True, SamplingParams(), 9),
    ], 16, pool_epoch="epoch-1", forget=["old/0", "old/1"], step=42, copies=[(3, 8), (5, 1)])
    b.errors[2] = "FedTokenUnknown: left out"
    return b


# what a rank reads of a sequence's Held; `history` and `prompt_len` are rank 0's running
# set's, which keeps the history (the other ranks get it as the step's prompt and output)
HELD = ("seq_id", "sampling", "seed", "prompt", "flags", "error")


def same(a: StepBatch, b: StepBatch) -> bool:
    """Every field equal, as each rank reads it (prompt and output through prompt_of and output_of)."""
    assert_same_batch(a, b, HELD, histories_as_read=True)
    return True


class Wire:
    """dist.broadcast between a sending rank 0 and a receiving rank, in one process."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.sending = True

    def broadcast(self, tensor, src):
        assert src == 0
        if self.sending:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.sent.pop(0))


@pytest.fixture
def wire(monkeypatch):
    w = Wire()
    monkeypatch.setattr(tp_broadcast.dist, "broadcast", w.broadcast)
    return w


def relay(wire: Wire, kind: str, payload):
    tp_broadcast.send(kind, payload, torch.device("cpu"))
    assert [t.dtype for t in wire.sent] == [torch.int64, torch.uint8]
    assert wire.sent[0].item() == wire.sent[1].numel()
    wire.sending = False
    got = tp_broadcast.receive(torch.device("cpu"))
    wire.sending = True
    assert wire.sent == []
    return got


@pytest.mark.parametrize("kind", ["execute", "logits"])
def test_a_step_arrives_equal(wire, kind):
    got_kind, got = relay(wire, kind, batch())
    assert got_kind == kind and same(got, batch())
    assert got.sampling(0).temperature == 0.1234567891 and got.sampling(0).min_p == 1e-46  # not rounded
    assert got.held[0].seed == 2**63 + 5 and got.prompt_of(0) == [11, 12, 13, 14]
    assert got.output_of(1) == [7, 8] and got.errors == {2: "FedTokenUnknown: left out"}
    assert not got.flags[0] & FLAG_INVALID and got.held[0].prompt == [11, 12, 13, 14]


def test_a_sequence_whose_sampling_is_not_valid_arrives_left_out_with_its_reason(wire):
    b = batch_of([Seq("ok", [1], 0, [0]), Seq("bad", [1], 0, [1], True, SamplingParams(min_tokens=9, max_tokens=2))],
                 16)
    assert b.flags[1] & FLAG_INVALID and "min_tokens" in b.errors[1]
    _, got = relay(wire, "execute", b)
    assert got.errors == b.errors and got.reports().tolist() == [True, True]


def test_the_test_step_sets_every_field_so_a_new_one_must_travel_too():
    b = batch()
    samplings = [h.sampling for h in b.held]
    for cls, objects in ((StepBatch, [b]), (SamplingParams, samplings)):
        for f in dataclasses.fields(cls):
            if f.name.startswith("_") or (f.default is dataclasses.MISSING
                                          and f.default_factory is dataclasses.MISSING):
                continue  # a cache; or a column every batch sets
            if f.name == "device_feed":
                continue  # a tensor of this process's device: never travels (step_to_proto refuses it)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            assert any(not _equal(getattr(o, f.name), default) for o in objects), \
                f"{cls.__name__}.{f.name}: set it here, and carry it in tensor_parallel.proto"
    assert set(Held.__slots__) == {*HELD, "history", "prompt_len"}, \
        "a new Held slot: carry it in tensor_parallel.proto and compare it in HELD"


def _equal(x, default) -> bool:
    return default is None and x is None if isinstance(x, np.ndarray) or x is None else x == default


def test_the_pools_the_heartbeat_and_stop_arrive(wire):
    pools = [("pagedserve-kv-1-a", [32, 2, 2, 4, 1, 8], "float32"), ("", [32, 2, 2, 4, 1, 8], "float32")]
    assert relay(wire, "attach", pools) == ("attach", pools)
    assert relay(wire, "ping", None) == ("ping", None)
    assert relay(wire, "stop", None) == ("stop", None)


def test_a_command_too_big_or_unknown_is_refused_before_anything_is_sent(wire, monkeypatch):
    monkeypatch.setattr(tp_broadcast, "MAX_COMMAND_BYTES", 64)
    with pytest.raises(ValueError, match="over the 64-byte limit"):
        tp_broadcast.send("execute", batch(), torch.device("cpu"))
    with pytest.raises(ValueError, match="no tensor-parallel command"):
        tp_broadcast.send("run_this", None, torch.device("cpu"))
    with pytest.raises(ValueError):  # a seed no uint64 holds: refused on rank 0, not half sent
        bad = batch()
        bad.held[0].seed = -1
        tp_broadcast.send("execute", bad, torch.device("cpu"))
    assert wire.sent == []


def test_nothing_in_the_executor_pickles_what_the_group_sends():
    """torch.distributed's *_object* collectives pickle; so would pickle itself."""
    for path in EXECUTOR.rglob("*.py"):
        text = path.read_text()
        for word in ("_object_list(", "_object(", "import pickle", "pickle.load"):
            assert word not in text, f"{path.name} uses {word}"
