"""The prefix cache holds only what was written: a property test over memsvc's Reserve with
steps that run, fail, or leave a sequence out (pagedserve.memsvc.unwritten_keys, pagedserve.memsvc.step_stamps).

The pool itself is the truth: a step that runs writes each token id into its slot of the
real pool tensor (K of layer 0); memsvc's own copies (copy-on-write) move them. Every
prefix hit a new sequence gets must read back exactly its prompt tokens: a block whose
writing step never ran would hold -1, or another sequence's tokens."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry

BS = 4
MAX_LEN = 20  # prompt and output of one sequence: 5 of the pool's 12 blocks
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 6, 6, 6, 6]]


@dataclass
class Step:
    stamp: int
    writes: list[tuple[str, list[int], list[int]]]  # (seq, slots, tokens)


class WrittenOnly(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mem = MemoryManager(MemoryConfig(num_blocks=12, watermark=0, preemption_mode="recompute",
                                              max_model_len=MAX_LEN))
        self.pool = self.mem.register_executor(KVGeometry(1, 1, 1, BS))
        self.pool.fill_(-1)
        self.tokens: dict[str, list[int]] = {}  # running sequence -> every token it holds
        self.inflight: list[Step] = []  # reserved, not run yet, in order
        self.written, self.void, self.failed = 0, False, []
        self.frees: list[str] = []
        self.n = 0
        self.hits = 0

    def _reserve(self, entries: list[PlanEntry], forks=()) -> None:
        plan = Plan(entries, free=self.frees, forks=list(forks), ahead=bool(self.inflight),
                    written=self.written, void=self.void, failed=self.failed)
        result = self.mem.reserve(plan)
        self.frees, self.void, self.failed = [], False, []
        for p in result.preempted:
            self.tokens.pop(p.seq_id, None)
        for r in result.rejected:
            self.tokens.pop(r.seq_id, None)
        for s in result.waiting:
            self.tokens.pop(s, None)
        if result.deferred:
            return
        writes = []
        by_id = {e.seq_id: e for e in entries}
        for g in result.grants:
            seq = self.tokens[g.seq_id]
            table = self.mem.allocator.block_table(g.seq_id)
            if by_id[g.seq_id].new:
                self._check_hit(g.seq_id, seq, table, g.num_cached_tokens)
            positions = range(g.start_pos, g.start_pos + g.num_tokens)
            writes.append((g.seq_id, [table[p // BS] * BS + p % BS for p in positions],
                           [seq[p] for p in positions]))
        self.inflight.append(Step(result.stamp, writes))

    def _check_hit(self, seq_id: str, prompt: list[int], table: list[int], cached: int) -> None:
        for p in range(cached):
            assert self.pool[table[p // BS], 0, 0, p % BS, 0, 0].item() == prompt[p], (
                f"{seq_id} got a prefix hit on a block not holding its tokens at position {p}")
        self.hits += cached > 0

    @rule(stem=st.sampled_from(STEMS), cut=st.sampled_from([4, 8]), tail=st.lists(st.integers(0, 9), max_size=5))
    def new_sequence(self, stem, cut, tail):
        seq_id, self.n = f"s{self.n}", self.n + 1
        prompt = stem[:cut] + tail
        self.tokens[seq_id] = list(prompt)
        running = [PlanEntry(s, [t[-1]], False, MAX_LEN) for s, t in self._decoding()]
        self._reserve(running + [PlanEntry(seq_id, prompt, True, MAX_LEN, max_new_tokens=len(prompt))])

    def _decoding(self):
        """Running sequences whose every token has a slot: each computes one more (a sample)."""
        out = []
        for s, t in self.tokens.items():
            if self.mem.allocator.has_sequence(s) and self.mem.allocator.num_tokens(s) == len(t) and len(t) < MAX_LEN:
                t.append((len(t) * 7 + len(s)) % 10)
                out.append((s, t))
        return out

    @rule()
    def decode(self):
        running = [PlanEntry(s, [t[-1]], False, MAX_LEN) for s, t in self._decoding()]
        if running:
            self._reserve(running)

    @precondition(lambda self: self.inflight)
    @rule(leave_out=st.booleans(), data=st.data())
    def run_oldest_step(self, leave_out, data):
        step = self.inflight.pop(0)
        out = None
        if leave_out and step.writes:  # the executor left one sequence out: it ends alone
            out = data.draw(st.sampled_from([w[0] for w in step.writes]))
            self.failed.append(out)
            self._end(out)
            for later in self.inflight:  # the executor leaves it out of every later step too
                later.writes = [w for w in later.writes if w[0] != out]
        for seq_id, slots, tokens in step.writes:
            if seq_id != out:
                for slot, token in zip(slots, tokens):
                    self.pool[slot // BS, 0, 0, slot % BS, 0, 0] = token
        self.written = step.stamp

    @precondition(lambda self: self.inflight)
    @rule()
    def fail_steps_in_flight(self):
        """A step failed: it and every step behind it never run; their sequences end."""
        for step in self.inflight:
            for seq_id, _, _ in step.writes:
                self._end(seq_id)
        self.inflight, self.void = [], True

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        self._end(data.draw(st.sampled_from(sorted(self.tokens))))

    @precondition(lambda self: not self.inflight and self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.mem.allocator.has_sequence(parent):
            return
        child, self.n = f"s{self.n}", self.n + 1
        self.tokens[child] = list(self.tokens[parent][:self.mem.allocator.num_tokens(parent)])
        self._reserve([], forks=[(parent, child)])

    def _end(self, seq_id: str) -> None:
        if self.tokens.pop(seq_id, None) is not None:
            self.frees.append(seq_id)

    @invariant()
    def pool_is_whole(self):
        self.mem.check_integrity()

    def teardown(self):
        self.inflight = []
        for s in list(self.tokens):
            self._end(s)
        self._reserve([])
        assert self.mem.stats().snapshot["blocks_referenced"] == 0


WrittenOnly.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_a_prefix_hit_is_never_served_for_an_unwritten_block = WrittenOnly.TestCase
