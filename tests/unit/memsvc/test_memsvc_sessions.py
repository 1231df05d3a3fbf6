"""Sessions: per-gateway namespaces of sequence ids, leases, and freeing what lapsed."""
from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire.protocol import KVGeometry
from pagedserve.wire.reserve_messages import Plan, PlanEntry


def manager(num_blocks=16, lease=10.0):
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, session_lease=lease))
    mem.register_executor(KVGeometry(1, 1, 1, 4))
    return mem


def new(seq_id, n=6, first=1, max_len=32):
    return PlanEntry(seq_id, list(range(first, first + n)), True, max_len)


def referenced(mem):
    return mem.stats().snapshot["blocks_referenced"]


def test_two_sessions_may_use_the_same_ids():
    mem = manager()
    ra = mem.reserve(Plan([new("0/0")]), session_id="a")
    rb = mem.reserve(Plan([new("0/0", 9)]), session_id="b")
    assert [g.seq_id for g in ra.grants] == ["0/0"] and [g.seq_id for g in rb.grants] == ["0/0"]
    assert ra.grants[0].new_blocks != rb.grants[0].new_blocks
    stats = mem.stats()
    assert (stats.num_sequences, stats.num_sessions) == (2, 2)
    mem.free(["0/0"], session_id="a")
    assert mem.stats().num_sequences == 1
    mem.check_integrity()


def test_a_lapsed_session_loses_its_sequences_and_others_keep_theirs():
    mem = manager(lease=5.0)
    mem.reserve(Plan([new("x/0"), new("y/0")]), session_id="gone")
    mem.reserve(Plan([new("x/0")]), session_id="alive")
    now = mem.sessions.by_id["gone"].last_seen
    mem.sessions.touch("alive", now + 4.0)
    assert mem.expire_sessions(now + 4.0) == {}
    assert mem.expire_sessions(now + 6.0) == {"gone": 2}
    assert mem.stats().num_sequences == 1
    assert list(mem.sessions.by_id) == ["alive"]
    mem.check_integrity()


def test_a_session_that_returns_gets_its_running_sequences_preempted():
    mem = manager()
    r = mem.reserve(Plan([new("s/0")]), session_id="g")
    mem.expire_sessions(mem.sessions.by_id["g"].last_seen + 11)
    assert referenced(mem) == 0
    r = mem.reserve(Plan([PlanEntry("s/0", [7], False, 32), new("t/0")]), session_id="g")
    assert [(p.seq_id, p.mode) for p in r.preempted] == [("s/0", "recompute")]
    assert [g.seq_id for g in r.grants] == ["t/0"]
    assert mem.sessions.by_id["g"].seqs == {"g|t/0"}


def test_finished_and_forked_sequences_are_tracked():
    mem = manager()
    mem.reserve(Plan([new("a/0", 8)]), session_id="g")
    mem.fork("a/0", "a/1", session_id="g")
    assert mem.sessions.by_id["g"].seqs == {"g|a/0", "g|a/1"}
    mem.reserve(Plan([], free=["a/0", "a/1"]), session_id="g")
    assert mem.sessions.by_id["g"].seqs == set()
    assert referenced(mem) == 0
    mem.check_integrity()


def test_a_preempted_sequence_is_no_longer_owned():
    mem = manager(num_blocks=4)
    r = mem.reserve(Plan([new("a/0", 4, max_len=16), new("b/0", 4, first=50, max_len=16)]), session_id="g")
    assert len(r.grants) == 2
    running = [PlanEntry("a/0", [1] * 4, False, 16), PlanEntry("b/0", [2] * 4, False, 16)]
    mem.reserve(Plan(running), session_id="g")
    running = [PlanEntry("a/0", [3], False, 16), PlanEntry("b/0", [4], False, 16)]
    r = mem.reserve(Plan(running), session_id="g")
    assert [p.seq_id for p in r.preempted] == ["b/0"]
    assert mem.sessions.by_id["g"].seqs == {"g|a/0"}
    mem.check_integrity()


def test_without_a_session_ids_are_used_as_given():
    mem = manager()
    r = mem.reserve(Plan([new("a/0")]))
    assert r.grants[0].seq_id == "a/0" and mem.allocator.has_sequence("a/0")
    assert mem.stats().num_sessions == 0


def test_memsvc_admits_no_new_sequence_for_a_session_over_its_share():
    mem = MemoryManager(MemoryConfig(num_blocks=32, session_lease=10.0))
    mem.register_executor(KVGeometry(1, 1, 1, 4))

    def new(seq_id, first):  # 20 tokens: 5 blocks of 4
        return PlanEntry(seq_id, list(range(first, first + 20)), True, 40)

    assert mem.reserve(Plan([new("0", 100)]), session_id="hog").grants
    assert mem.reserve(Plan([new("0", 200)]), session_id="other").grants  # two sessions: 16 blocks each
    for i in (1, 2, 3):  # holding 5, 10, 15 < 16: admitted
        assert [g.seq_id for g in mem.reserve(Plan([new(str(i), 100 * i + 300)]), session_id="hog").grants] == [str(i)]
    held = mem.reserve(Plan([new("4", 900)]), session_id="hog")  # 20 >= 16: waits
    assert not held.grants and held.waiting == ["4"]
    later = mem.reserve(Plan([new("1", 1000)]), session_id="other")  # the other one still starts
    assert [g.seq_id for g in later.grants] == ["1"]
    mem.check_integrity()


def test_a_swapped_sequence_comes_back_under_the_session_id():
    mem = MemoryManager(MemoryConfig(num_blocks=4, num_host_blocks=8, preemption_mode="swap"))
    mem.register_executor(KVGeometry(1, 1, 1, 4))
    mem.reserve(Plan([new("a/0", 4, max_len=16), new("b/0", 4, first=50, max_len=16)]), session_id="g")
    running = [PlanEntry("a/0", [1] * 4, False, 16), PlanEntry("b/0", [2] * 4, False, 16)]
    mem.reserve(Plan(running), session_id="g")
    running = [PlanEntry("a/0", [3], False, 16), PlanEntry("b/0", [4], False, 16)]
    r = mem.reserve(Plan(running), session_id="g")
    assert [(p.seq_id, p.mode) for p in r.preempted] == [("b/0", "swap")]
    r = mem.reserve(Plan([PlanEntry("b/0", [4], False, 16)], free=["a/0"]), session_id="g")
    assert r.resumed == ["b/0"] and [g.seq_id for g in r.grants] == ["b/0"]
    mem.check_integrity()


def test_every_answer_names_the_pool_in_process_too():
    mem, other = manager(), manager()
    r = mem.reserve(Plan([new("a/0")]), session_id="g")
    assert r.pool_epoch == mem.pool_epoch == mem.reserve(Plan([])).pool_epoch
    assert r.pool_epoch and r.pool_epoch != other.pool_epoch
