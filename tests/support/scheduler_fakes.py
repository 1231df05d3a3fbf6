"""The Scheduler's tests' fakes and helpers: sequences and a scheduler as the BatchLoop makes
them, `FakeMem` (grants every plan entry its tokens from block ids it picks), hand-made
memsvc answers, and one step driven through plan, answer and sampled tokens. Used by
tests/unit/gateway/test_scheduler_*.py."""
from __future__ import annotations

from types import SimpleNamespace

from pagedserve.gateway.scheduler import Scheduler
from pagedserve.gateway.scheduler_config import SchedulerConfig
from pagedserve.gateway.sequence import Sequence
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.protocol import SampleOutput, SamplingParams
from pagedserve.wire.reserve_messages import Grant, Grants, Plan, ReserveResult

BS = 4  # block size of every test
EOS = 2


def make_seq(seq_id, prompt, *, max_tokens=8, max_len=None, arrival=0.0, priority=0, index=0,
             request_id=None, **sampling):
    """A sequence as the BatchLoop makes one (max_len: prompt + max_tokens unless given)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    return Sequence(seq_id, request_id or seq_id.split("/")[0], index, list(prompt), sp, seed=7,
                    max_len=len(prompt) + max_tokens if max_len is None else max_len,
                    arrival=arrival, priority=priority)


def make_sched(**config):
    return Scheduler(SchedulerConfig(**config), eos_token_ids=[EOS], block_size=BS)


def slots_of(table, start, end):
    return [table[p // BS] * BS + p % BS for p in range(start, end)]


class FakeMem:
    """Grants every entry of a plan all of its tokens (a new one: up to max_new_tokens after
    its cached prefix), with fresh block ids counting up from `first_block`; keeps each
    sequence's table and computed count as memsvc would, applies forks and frees."""

    def __init__(self, first_block=100):
        self.next_block = first_block
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.plans: list[Plan] = []
        self.forked: set[str] = set()  # children whose first grant carries their whole table

    def reserve(self, plan: Plan, cached: dict[str, int] | None = None) -> ReserveResult:
        self.plans.append(plan)
        for parent, child in plan.forks:
            self.tables[child] = list(self.tables[parent])
            self.computed[child] = self.computed[parent]
            self.forked.add(child)
        for seq_id in plan.free:
            self.tables.pop(seq_id, None)
            self.computed.pop(seq_id, None)
        grants = []
        for e in rows(plan):
            if e.new:
                start = (cached or {}).get(e.seq_id, 0)
                n = min(len(e.token_ids) - start, e.max_new_tokens)
                table = self.tables[e.seq_id] = []
            else:
                start, table = self.computed[e.seq_id], self.tables[e.seq_id]
                n = len(e.token_ids) + e.pending
            table_start = 0 if e.seq_id in self.forked else len(table)
            self.forked.discard(e.seq_id)
            need = -(-(start + n) // BS) - len(table)
            new_blocks = list(range(self.next_block, self.next_block + max(need, 0)))
            self.next_block += len(new_blocks)
            table.extend(new_blocks)
            self.computed[e.seq_id] = start + n
            grants.append(Grant(e.seq_id, start, n, table_start, table[table_start:], start if e.new else 0))
        return answer(grants)


def answer(grants=(), **kw) -> ReserveResult:
    """memsvc's answer granting `grants` (Grant rows, in columns)."""
    g = Grants()
    for x in grants:
        g.add(x.seq_id, x.start_pos, x.num_tokens, x.table_start, list(x.new_blocks), x.num_cached_tokens)
    return ReserveResult(g, **kw)


def rows(plan):
    """The plan's sequences one by one: running ones (`pending`: their tokens end with
    PENDING, left out of `token_ids`), then the new ones."""
    out, at = [], 0
    for seq_id, n in zip(plan.run_ids, plan.run_counts):
        tokens = plan.run_tokens[at:at + n]
        at += n
        pending = bool(tokens) and tokens[-1] == PENDING
        out.append(SimpleNamespace(seq_id=seq_id, token_ids=tokens[:-1] if pending else tokens, new=False,
                                   pending=pending))
    return out + [SimpleNamespace(seq_id=e.seq_id, token_ids=e.token_ids, new=True, pending=False,
                                  max_len=e.max_len, max_new_tokens=e.max_new_tokens) for e in plan.entries]


def steps(batch):
    """The step's sequences one by one."""
    out, at, bat = [], 0, 0
    for i, seq_id in enumerate(batch.seq_ids):
        n, k = batch.num_tokens[i], batch.num_new_blocks[i]
        out.append(SimpleNamespace(seq_id=seq_id, token_ids=batch.token_ids[at:at + n], start_pos=batch.start_pos[i],
                                   sample=batch.sample[i], table_start=batch.table_start[i],
                                   new_blocks=batch.new_blocks[bat:bat + k], seq=batch.seqs[i]))
        at, bat = at + n, bat + k
    return out


def sample(sched, batch, tokens=None, default=50):
    """Outputs for every step of `batch` that samples (token ids from `tokens` by seq id), applied."""
    tokens = tokens or {}
    outs = [SampleOutput(s.seq_id, tokens.get(s.seq_id, default), logprob=-0.5)
            for s in steps(batch) if s.sample]
    return sched.on_sampled(batch, outs)


def step(sched, mem, tokens=None, **kw):
    """One serial step: plan, reserve, apply, sample. Returns (plan, batch, updates)."""
    plan = sched.plan()
    batch, rejected = sched.on_reserved(mem.reserve(plan, **kw))
    assert rejected == []
    return plan, batch, sample(sched, batch, tokens)


def decode(sched, seq_id):
    """A grant of the next token of a running sequence in a block it already has (no table change)."""
    seq = sched.seqs[seq_id]
    return Grant(seq_id, seq.num_computed, 1, -(-(seq.num_computed + 1) // BS))


def ids(entries):
    return [e.seq_id for e in entries]


def running_pair():
    """`a` and `b` running: prompts of 5, one token each drawn (50), FakeMem tables."""
    sched, mem = make_sched(), FakeMem()
    sched.add(make_seq("a", range(10, 15)))
    sched.add(make_seq("b", range(20, 25), arrival=1.0))
    step(sched, mem)
    return sched, mem


def add_samples(sched, prompt, n=3):
    seqs = [make_seq(f"r/{i}", prompt, index=i, request_id="r") for i in range(n)]
    sched.add(seqs[0], seqs[1:])
    return seqs
