"""Every step conversion round-trips random messages through the wire, empty and edge values
among them: ids that are empty, repeated, non-ASCII or hold a newline (the id columns travel
joined by newlines otherwise), columns of none, one and many, the largest values a field holds,
new sequences in columns or as messages, and a steady step's columns (fills naming the running
sequences, one PENDING token each, one token granted each, none cached, no new block: each
travels as a flag)."""
import random

import pytest

from pagedserve.wire import id_columns, step_convert
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import PromptLogprob, SampleOutput
from pagedserve.wire.reserve_messages import Grants, Plan, PlanEntry, Preemption, Rejection, ReserveResult
from pagedserve.wire.v1 import executor_pb2

U32 = 2**32 - 1
ODD_IDS = ["", "\n", "a\nb", "é/0", "x" * 300, " ", "\n\n", "r/0"]


def wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def ids(rng: random.Random, n: int) -> list[str]:
    odd = rng.random() < 0.3
    return [rng.choice(ODD_IDS) if odd and rng.random() < 0.3 else f"r{rng.randrange(10**6)}/{rng.randrange(4)}"
            for _ in range(n)]


def size(rng: random.Random) -> int:
    return rng.choice([0, 0, 1, 2, rng.randrange(3, 300)])


def u32(rng: random.Random) -> int:
    return rng.choice([0, 1, U32, rng.randrange(U32)])


def plan(rng: random.Random) -> Plan:
    run = ids(rng, size(rng))
    steady = rng.random() < 0.3
    counts = [1 if steady else rng.randint(1, 3) for _ in run]
    choices = [PENDING] if steady else [PENDING, 0, 2**31 - 1, rng.randrange(50000)]
    plain = rng.random() < 0.5  # no final_len nor salt: the new sequences travel in columns
    return Plan(
        entries=[PlanEntry(i, [u32(rng) for _ in range(size(rng))], True, u32(rng), u32(rng),
                           None if plain else rng.choice([None, 0, u32(rng)]),
                           None if plain else rng.choice([None, "", "salt\n"]), rng.random() < 0.5)
                 for i in ids(rng, rng.choice([0, 1, 3]))],
        free=ids(rng, size(rng)), step_tokens=u32(rng), step_seconds=rng.random(),
        forks=list(zip(ids(rng, 2), ids(rng, 2))) if rng.random() < 0.3 else [], ahead=rng.random() < 0.5,
        fills=[(i, u32(rng), u32(rng)) for i in (run if rng.random() < 0.3 else ids(rng, size(rng)))],
        written=rng.randrange(2**64),
        void=rng.random() < 0.5, failed=ids(rng, size(rng)), run_ids=run, run_counts=counts,
        run_tokens=[rng.choice(choices) for _ in range(sum(counts))])


def result(rng: random.Random) -> ReserveResult:
    g = Grants()
    decode, no_new = rng.random() < 0.3, rng.random() < 0.3
    for i in ids(rng, size(rng)):
        g.add(i, u32(rng), 1 if decode else u32(rng), u32(rng),
              [] if no_new else [u32(rng) for _ in range(rng.choice([0, 0, 1, 5]))], 0 if decode else u32(rng))
    return ReserveResult(g, [Preemption(i, rng.choice(["swap", "recompute"])) for i in ids(rng, size(rng) % 4)],
                         [Rejection(i, "too long") for i in ids(rng, size(rng) % 3)], ids(rng, size(rng)),
                         ids(rng, size(rng)), rng.choice(["", "epoch"]), rng.random() < 0.5,
                         [(u32(rng), u32(rng)) for _ in range(size(rng) % 4)], rng.randrange(2**64))


def outputs(rng: random.Random) -> list[SampleOutput]:
    plain = rng.random() < 0.5  # tokens alone travel packed
    out = []
    for i in ids(rng, size(rng)):
        if plain or rng.random() < 0.5:
            out.append(SampleOutput(i, u32(rng)))
        elif rng.random() < 0.5:
            out.append(SampleOutput(i, u32(rng), -0.5, [(u32(rng), -1.25)], True,
                                   [PromptLogprob(u32(rng), -0.75, 3, [(1, -0.5)])]))
        else:
            out.append(SampleOutput(i, -1, sampled=False, error=rng.choice(["", "left out"])))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_step_messages_round_trip(seed):
    rng = random.Random(seed)
    p = plan(rng)
    assert step_convert.plan_from_proto(wire(step_convert.plan_to_proto(p, "s"))) == p
    r = result(rng)
    assert step_convert.reserve_result_from_proto(wire(step_convert.reserve_result_to_proto(r))) == r
    o = outputs(rng)
    sampled = [x.seq_id for x in o]
    assert step_convert.outputs_from_proto(wire(step_convert.outputs_to_proto(o, "inc")), sampled) == o


@pytest.mark.parametrize("column", [[], [""], ["", ""], ["a"], ["a\nb", "c"], ["\n"], ["a", ""], ["é", "ü/1"]])
def test_an_id_column_comes_back_as_it_went(column):
    repeated, joined = id_columns.join_ids(column)
    assert not (repeated and joined)
    m = wire(executor_pb2.ExecuteRequest(seq_ids=repeated, joined_seq_ids=joined))
    assert id_columns.split_ids(m.seq_ids, m.joined_seq_ids) == column
