"""The prefix cache's host tier (pagedserve.memsvc.host_tier, pagedserve.memsvc.prefix_offload) on the allocator:
what is offloaded and restored, in which order the copies come, salts, a full or empty
tier, plans made ahead, and the integrity check over random acts with the block contents
followed through every copy."""
import random

import pytest

from pagedserve.memsvc import IntegrityError, PagedAllocator
from pagedserve.memsvc.host_tier import HostTier
from tests.support.written import ran

BS = 4
A = list(range(100, 113))  # 13 tokens: 3 full blocks + 1


def alloc(num_blocks=4, tier=8, **kw):
    a = PagedAllocator(num_blocks, BS, num_offload_blocks=tier, **kw)
    a.offload.begin()
    return a


def start(a, seq_id, prompt, **kw):
    cached = a.add_sequence(seq_id, prompt, max_len=len(prompt) + 3, **kw)
    a.append(seq_id, prompt[cached:])
    return cached


def step(a):
    """A Reserve ends and the next begins (the step in between ran)."""
    copies = a.take_copies()
    ran(a)
    a.offload.begin()
    return copies


def test_the_tier_keeps_lru_order_and_never_answers_another_salt():
    t = HostTier(2)
    assert t.store(b"a", None) == 0 and t.store(b"b", "x") == 1
    assert t.store(b"a", None) is None  # held already: touched, nothing to copy
    assert t.store(b"c", None) == 1  # full: b, the least recently used, goes
    assert b"b" not in t and t.stats.evicted == 1
    assert t.lookup(b"a", "x") is None and t.lookup(b"a", None).host_block == 0
    assert (t.stats.lookups, t.stats.hits) == (2, 1)
    t.pin([b"a", b"c"])
    assert t.store(b"d", None) is None and t.stats.dropped == 1  # every entry pinned
    with pytest.raises(IntegrityError, match="pinned"):
        t.check()
    t.unpin([b"a", b"c"])
    t.check()
    with pytest.raises(ValueError, match="--kv-offload"):
        HostTier(-1)


def test_an_evicted_block_is_offloaded_and_a_later_prompt_restores_it():
    a = alloc()
    start(a, "a", A)
    a.free("a")
    step(a)
    start(a, "b", list(range(300, 313)))  # takes the whole pool: a's 3 cached blocks evicted
    copies = step(a)
    assert [c[0] for c in copies] == ["offload"] * 3
    assert a.offload.tier.num_used == 3
    a.free("b")
    step(a)
    assert a.admit(A, len(A) + 3).kind == "yes"
    assert start(a, "c", A) == 12  # every full block of A, from the host tier
    copies = step(a)
    restores = [c for c in copies if c[0] == "restore"]
    assert len(restores) == 3
    assert [c[2] for c in restores] == a.block_table("c")[:3]
    # b's blocks were evicted to make room for them: their offloads come first
    first_restore = copies.index(restores[0])
    assert all(c[0] == "offload" for c in copies[:first_restore])
    assert (a.prefix_cache_hits, a.offload.tokens_restored) == (12, 12)
    a.check_integrity()


def test_a_block_whose_step_has_not_run_or_may_still_run_is_not_offloaded():
    a = alloc()
    start(a, "a", A)
    a.free("a")
    start(a, "b", list(range(300, 313)))  # same act: a's blocks hold nothing yet, no key
    assert a.take_copies() == [] and a.offload.tier.num_used == 0
    a = alloc()
    stamp = a.offload.begin()
    start(a, "a", A)
    a.free("a")
    ran(a)
    a.offload.begin(unsafe=[stamp])  # that Reserve's step may still run
    start(a, "b", list(range(300, 313)))
    assert a.take_copies() == [] and a.offload.tier.num_used == 0


def test_a_plan_made_ahead_restores_nothing():
    a = alloc()
    start(a, "a", A)
    a.free("a")
    step(a)
    start(a, "b", list(range(300, 313)))
    a.free("b")
    a.take_copies()
    a.offload.begin(restore_allowed=False)
    assert start(a, "c", A) == 0
    assert not [c for c in a.take_copies() if c[0] == "restore"]


def test_salts_keep_their_meaning_in_the_tier():
    a = alloc()
    start(a, "a", A, salt="tenant-1")
    a.free("a")
    step(a)
    start(a, "b", list(range(300, 313)))
    a.free("b")
    step(a)
    assert start(a, "c", A, salt="tenant-2") == 0
    a.free("c")
    step(a)
    assert start(a, "d", A, salt="tenant-1") == 12
    a.check_integrity()


def test_a_tier_of_size_zero_or_without_prefix_caching_is_off():
    assert PagedAllocator(4, BS, num_offload_blocks=0).offload is None
    assert PagedAllocator(4, BS, num_offload_blocks=4, enable_prefix_caching=False).offload is None


def test_a_full_tier_drops_its_least_recently_used_blocks():
    a = alloc(num_blocks=4, tier=2)
    start(a, "a", A)
    a.free("a")
    step(a)
    start(a, "b", list(range(300, 313)))
    # tail blocks are evicted first, so the third offload (the chain's head) takes the
    # host block of the first (its tail), copied after it
    assert step(a) == [("offload", 2, 0), ("offload", 1, 1), ("offload", 0, 0)]
    assert a.offload.tier.stats.evicted == 1
    a.free("b")
    step(a)
    assert start(a, "c", A) == 8  # the chain's first two blocks
    a.check_integrity()


def test_use_cache_false_attaches_nothing_from_the_tier():
    a = alloc()
    start(a, "a", A)
    a.free("a")
    step(a)
    start(a, "b", list(range(300, 313)))
    a.free("b")
    step(a)
    assert start(a, "c", A, use_cache=False) == 0


class Contents:
    """What each pool and host block holds, moved by the copies as memsvc would move them."""

    def __init__(self, a):
        self.a, self.pool, self.host = a, {}, {}

    def apply(self, copies):
        for kind, src, dst in copies:
            if kind == "offload":
                self.host[dst] = self.pool.get(src)
            elif kind == "restore":
                self.pool[dst] = self.host.get(src)
            elif kind == "cow":
                self.pool[dst] = self.pool.get(src)

    def write(self, seq_id, prompt, start):
        table = self.a.block_table(seq_id)
        for p in range(start, len(prompt)):
            block = self.pool.setdefault(table[p // BS], [None] * BS)
            self.pool[table[p // BS]] = block = list(block)
            block[p % BS] = prompt[p]

    def check(self, seq_id, prompt, cached):
        table = self.a.block_table(seq_id)
        for i in range(cached // BS):
            assert self.pool.get(table[i]) == prompt[i * BS:(i + 1) * BS], (seq_id, i)


@pytest.mark.parametrize("seed", range(6))
def test_random_acts_keep_integrity_and_every_hit_holds_its_tokens(seed):
    rng = random.Random(seed)
    a = alloc(num_blocks=rng.randint(6, 12), tier=rng.randint(1, 10))
    contents = Contents(a)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live = {}
    for n in range(120):
        op = rng.random()
        if op < 0.5:
            prompt = rng.choice(stems)[:rng.choice((4, 8, 12))] + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            salt = rng.choice((None, None, "t"))
            if a.admit(prompt, len(prompt) + 4, salt).kind != "yes":
                continue
            seq_id = f"s{n}"
            cached = a.add_sequence(seq_id, prompt, max_len=len(prompt) + 4, salt=salt)
            contents.apply(a.take_copies())
            contents.check(seq_id, prompt, cached)
            if a.num_new_blocks(seq_id, len(prompt) - cached) > a.num_free_blocks():
                a.free(seq_id)
                continue
            r = a.append(seq_id, prompt[cached:])
            contents.apply(a.take_copies() + [("cow", s, d) for s, d in r.copies])
            contents.write(seq_id, prompt, cached)
            live[seq_id] = prompt
        elif live:
            seq_id = rng.choice(sorted(live))
            a.free(seq_id)
            del live[seq_id]
        a.check_integrity()
        ran(a)  # the step ran: what it wrote is final (Contents.write)
        a.offload.begin()
    for seq_id in live:
        a.free(seq_id)
    a.check_integrity()
    assert a.snapshot().blocks_referenced == 0
    assert a.offload.tier.stats.restored > 0  # the walk did reach the tier
