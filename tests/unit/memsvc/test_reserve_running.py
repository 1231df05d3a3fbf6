"""memsvc's column path for a plan made ahead whose entries are all running
(MemoryManager.reserve_running, what the server takes for such a Reserve) answers exactly
what the general path (`reserve` of the same plan) answers, and leaves the same pool behind:
grants, deferrals, frees, fills, host-tier offloads of the blocks growth evicts."""
import random

import pytest

from memsvc.memory_manager import MemoryConfig, MemoryManager
from memsvc.step_stamps import StepStamps
from wire import convert
from wire.protocol import KVGeometry, Plan, PlanEntry

BS = 4
SESSION = "gw"


def manager(num_blocks: int, tier: int) -> MemoryManager:
    mem = MemoryManager(MemoryConfig(num_blocks=num_blocks, num_offload_blocks=tier, offload_policy="always",
                                     watermark=0, max_model_len=256))
    mem.register_executor(KVGeometry(1, 1, 1, BS))
    mem.stamps = StepStamps(start=1)  # both managers stamp alike
    return mem


def answer(mem: MemoryManager, request, columns: bool):
    if columns:
        cols = convert.running_columns(request)
        assert cols is not None
        response = convert.run_grants_to_proto(cols[0], cols[1], cols[3], *mem.reserve_running(SESSION, *cols))
    else:
        response = convert.reserve_result_to_proto(mem.reserve(convert.plan_from_proto(request), SESSION))
    response.pool_epoch = ""
    return response


def tables(mem: MemoryManager) -> dict:
    alloc = mem.allocator
    return {s: (alloc.block_table(s), alloc.num_tokens(s)) for s in alloc.sequence_ids()}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tier", [0, 16])
def test_the_column_path_answers_what_the_general_path_answers(seed, tier):
    rng = random.Random(seed)
    general, column = manager(40, tier), manager(40, tier)
    running: dict[str, int] = {}  # seq id -> tokens held
    pending: dict[str, int] = {}  # seq id -> position memsvc holds as pending
    next_id, deferred, offloaded_ahead = 0, 0, 0
    written = 0  # the stamp of the last step that ran: each plan says its step before ran
    for step in range(60):
        free = [s for s in running if rng.random() < 0.08]
        for s in free:
            running.pop(s)
            pending.pop(s, None)
        if len(running) < 3 or rng.random() < 0.2:  # admit one, through the general path alone
            seq_id, next_id = f"s{next_id}", next_id + 1
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]  # small alphabet: prefix hits
            plan = Plan([PlanEntry(seq_id, prompt, True, 64, max_new_tokens=len(prompt))], free=free,
                        written=written)
            request = convert.plan_to_proto(plan, SESSION)
            a, b = answer(general, request, False), answer(column, request, False)
            assert a == b
            written = a.stamp
            if list(a.grant_seq_ids) == [seq_id]:
                running[seq_id] = len(prompt)
            continue
        fills = [(s, pos, rng.randrange(3)) for s, pos in pending.items()]
        entries = []
        for s in running:
            n = rng.choice([0, 0, 1, 2])
            entries.append(PlanEntry(s, [rng.randrange(3) for _ in range(n)], False, 64,
                                     pending=n == 0 or rng.random() < 0.5))
        if rng.random() < 0.1:
            entries.append(PlanEntry("unknown", [], False, 64, pending=True))  # deferred
        plan = Plan(entries, free=free, ahead=True, fills=fills, step_tokens=len(entries), step_seconds=0.01,
                    written=written)
        request = convert.plan_to_proto(plan, SESSION)
        before = column.allocator.offload.tier.stats.offloaded if tier else 0
        a, b = answer(general, request, False), answer(column, request, True)
        assert a == b, step
        written = a.stamp or written
        offloaded_ahead += (column.allocator.offload.tier.stats.offloaded if tier else 0) - before
        assert tables(general) == tables(column)
        assert general.allocator.num_free_blocks() == column.allocator.num_free_blocks()
        general.check_integrity()
        column.check_integrity()
        pending = {}
        if a.deferred:
            deferred += 1
            continue
        for e, start, n in zip(entries, a.grant_start_pos, a.grant_num_tokens):
            running[e.seq_id] = start + n
            if e.pending:
                pending[e.seq_id] = start + n - 1
    assert deferred > 0  # both deferred some plans (a full pool, an unknown sequence)
    if tier:
        assert general.allocator.offload.tier.stats.offloaded == column.allocator.offload.tier.stats.offloaded
        assert offloaded_ahead > 0  # growth in a plan made ahead evicted cached blocks to the tier


def test_other_plans_take_the_general_path():
    plan = Plan([PlanEntry("a", [1], False, 10)], ahead=False)
    assert convert.running_columns(convert.plan_to_proto(plan, SESSION)) is None
    plan = Plan([PlanEntry("a", [], False, 10, pending=True), PlanEntry("b", [1], True, 10)], ahead=True)
    assert convert.running_columns(convert.plan_to_proto(plan, SESSION)) is None
    request = convert.plan_to_proto(Plan([PlanEntry("a", [1, 2], False, 10)], ahead=True), SESSION)
    del request.run_token_ids[1:]
    with pytest.raises(ValueError, match="do not agree"):
        convert.running_columns(request)
