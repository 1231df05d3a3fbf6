"""Random operation sequences against the allocators, with a model of the pool's memory.

The paged machine keeps a fake pool (block -> token per slot) and a fake host store. It
performs every copy the allocator returns and writes every appended token into the slot it
was given, then checks after each step that reading each sequence through its block table
gives back exactly its tokens. That catches a wrong slot, a missing copy-on-write, a stale
prefix-cache hit, or a bad swap pair, on top of check_integrity's bookkeeping.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.memsvc import ContiguousAllocator, NoFreeBlocks, PagedAllocator
from pagedserve.memsvc.block_table import blocks_for
from pagedserve.memsvc.contiguous_allocator import CONTIGUOUS_POLICIES

BS = 4
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]]
SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class PagedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PagedAllocator(12, BS, num_host_blocks=6)
        self.mem: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.tokens: dict[str, list[int]] = {}  # tokens with slots, per sequence
        self.pending: dict[str, list[int]] = {}  # prompt tokens still to append
        self.salt: dict[str, str | None] = {}
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _on_device(self) -> list[str]:
        return [s for s in self.tokens if not self.alloc.is_swapped(s)]

    def _swapped(self) -> list[str]:
        return [s for s in self.tokens if self.alloc.is_swapped(s)]

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=6),
        extra=st.integers(0, 12),
        salt=st.sampled_from([None, "t"]),
    )
    def add(self, prefix, tail, extra, salt):
        prompt = prefix + tail or [0]
        max_len = len(prompt) + extra
        adm = self.alloc.admit(prompt, max_len, salt)
        if adm.kind == "never":
            assert blocks_for(max_len, BS) > self.alloc.num_blocks
            return
        seq_id = self._new_id()
        cached = self.alloc.add_sequence(seq_id, prompt, max_len=max_len, salt=salt)
        assert cached % BS == 0 and cached <= len(prompt) - 1
        # admission said yes exactly when the uncached prompt can get its blocks now
        assert (adm.kind == "yes") == self.alloc.can_append(seq_id, len(prompt) - cached)
        self.tokens[seq_id] = prompt[:cached]
        self.pending[seq_id] = prompt[cached:]
        self.salt[seq_id] = salt

    @precondition(lambda self: self._on_device())
    @rule(data=st.data(), k=st.integers(1, 6))
    def append(self, data, k):
        seq_id = data.draw(st.sampled_from(self._on_device()))
        pending = self.pending[seq_id]
        generated = max(k - len(pending), 0)  # decode tokens after the prompt
        new = pending[:k] + data.draw(st.lists(st.integers(0, 3), min_size=generated, max_size=generated))
        if not self.alloc.can_append(seq_id, k):
            before = (self.alloc.block_table(seq_id), self.alloc.num_free_blocks())
            with pytest.raises(NoFreeBlocks):
                self.alloc.append(seq_id, new)
            assert (self.alloc.block_table(seq_id), self.alloc.num_free_blocks()) == before
            return
        expect_new = self.alloc.num_new_blocks(seq_id, k)
        free_before = self.alloc.num_free_blocks()
        result = self.alloc.append(seq_id, new)
        assert self.alloc.num_free_blocks() == free_before - expect_new
        for src, dst in result.copies:  # copy-on-write, before writing
            self.mem[dst] = list(self.mem[src])
        assert len(result.slot_mapping) == k == len(set(result.slot_mapping))
        for slot, token in zip(result.slot_mapping, new):
            block = slot // BS
            assert self.alloc.pool.blocks[block].ref_cnt == 1, "wrote into a shared block"
            self.mem.setdefault(block, [None] * BS)[slot % BS] = token
        self.tokens[seq_id] += new
        del pending[: len(new)]

    @precondition(lambda self: self._on_device() and len(self.tokens) < 6)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._on_device()))
        child = self._new_id()
        free_before = self.alloc.num_free_blocks()
        self.alloc.fork(parent, child)
        assert self.alloc.num_free_blocks() == free_before
        self.tokens[child] = list(self.tokens[parent])
        self.pending[child] = list(self.pending[parent])
        self.salt[child] = self.salt[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.alloc.free(seq_id)
        del self.tokens[seq_id], self.pending[seq_id], self.salt[seq_id]
        with pytest.raises(KeyError):
            self.alloc.free(seq_id)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self._on_device()))
        table = self.alloc.block_table(seq_id)
        if not self.alloc.can_swap_out(seq_id):
            with pytest.raises(NoFreeBlocks):
                self.alloc.swap_out(seq_id)
            return
        pairs = self.alloc.swap_out(seq_id)
        assert [d for d, _ in pairs] == table
        for dev, host in pairs:
            self.host[host] = list(self.mem[dev])

    @precondition(lambda self: self._swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(self._swapped()))
        if not self.alloc.can_swap_in(seq_id):
            with pytest.raises(NoFreeBlocks):
                self.alloc.swap_in(seq_id)
            return
        pairs = self.alloc.swap_in(seq_id)
        assert [d for _, d in pairs] == self.alloc.block_table(seq_id)
        for host, dev in pairs:
            self.mem[dev] = list(self.host[host])

    @invariant()
    def consistent(self):
        self.alloc.check_integrity()
        salt_of_block: dict[int, str | None] = {}
        for seq_id, tokens in self.tokens.items():
            assert self.alloc.num_tokens(seq_id) == len(tokens)
            if self.alloc.is_swapped(seq_id):
                continue
            table = self.alloc.block_table(seq_id)
            for b in table:  # blocks are shared only within one salt
                assert salt_of_block.setdefault(b, self.salt[seq_id]) == self.salt[seq_id]
            assert len(table) == blocks_for(len(tokens), BS)
            read = [self.mem[table[p // BS]][p % BS] for p in range(len(tokens))]
            assert read == tokens, f"{seq_id} reads {read}, expected {tokens}"
        snap = self.alloc.snapshot()  # validates that the categories partition the pool
        assert snap.blocks_free + snap.blocks_cached == self.alloc.num_free_blocks()
        assert snap.token_state <= sum(len(t) for t in self.tokens.values())


class ContiguousMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[str, int] = {}
        self.final: dict[str, int | None] = {}
        self.counter = 0

    @initialize(policy=st.sampled_from(CONTIGUOUS_POLICIES))
    def make(self, policy):
        self.alloc = ContiguousAllocator(16, BS, policy, max_model_len=24)

    @rule(prompt_len=st.integers(1, 10), extra=st.integers(0, 14), data=st.data())
    def add(self, prompt_len, extra, data):
        max_len = min(prompt_len + extra, 24)
        final_len = data.draw(st.none() | st.integers(prompt_len, max_len))
        adm = self.alloc.admit([1] * prompt_len, max_len, final_len=final_len)
        need = self.alloc.reservation_blocks(max_len, final_len)
        assert (adm.kind == "never") == (need > self.alloc.num_blocks)
        longest = self.alloc.runs.largest_free_run()
        assert (adm.kind == "wait") == (need <= self.alloc.num_blocks and need > longest)
        self.counter += 1
        seq_id = f"s{self.counter}"
        if adm.kind != "yes":
            with pytest.raises(NoFreeBlocks):
                self.alloc.add_sequence(seq_id, [1] * prompt_len, max_len=max_len, final_len=final_len)
            return
        self.alloc.add_sequence(seq_id, [1] * prompt_len, max_len=max_len, final_len=final_len)
        self.alloc.append(seq_id, [1] * prompt_len)
        self.tokens[seq_id] = prompt_len
        self.final[seq_id] = final_len

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 4))
    def append(self, data, k):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        run = self.alloc.reserved_run(seq_id)
        k = min(k, run.length * BS - self.tokens[seq_id])
        if k == 0:
            return
        slots = self.alloc.append(seq_id, [2] * k).slot_mapping
        start = run.start * BS + self.tokens[seq_id]
        assert slots == list(range(start, start + k))
        self.tokens[seq_id] += k

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.alloc.free(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def consistent(self):
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_integrity()
        snap = self.alloc.snapshot(next_request_blocks=3)
        assert snap.token_state == sum(self.tokens.values())
        assert snap.blocks_free == self.alloc.num_free_blocks()
        assert snap.external_fragmentation == BS * sum(
            r.length for r in self.alloc.runs.free_runs() if r.length < 3
        )


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = SETTINGS
TestContiguousMachine = ContiguousMachine.TestCase
TestContiguousMachine.settings = SETTINGS
