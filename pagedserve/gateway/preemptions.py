"""memsvc's preemptions and resumptions applied to the scheduler's queues (the start of
`Scheduler.on_reserved`): a sequence swapped out waits in `swapped`, its blocks on the host;
one preempted to recompute waits in `waiting` from scratch (memsvc holds no pending token
of it any more); one resumed runs again. See docs/ARCHITECTURE.md, "Prefix cache, sharing
and preemption"."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.gateway.seq_queue import insert
from pagedserve.gateway.sequence import SeqStatus
from pagedserve.wire.reserve_messages import ReserveResult

if TYPE_CHECKING:
    from pagedserve.gateway.scheduler import Scheduler


def apply(sched: Scheduler, result: ReserveResult) -> None:
    """Move the sequences `result` preempted or resumed to the queues their status names."""
    for p in result.preempted:
        seq = sched.seqs[p.seq_id]
        for queue in (sched.running, sched.swapped):
            if seq in queue:
                queue.remove(seq)
        seq.num_preemptions += 1
        if p.mode != "swap":
            sched.pending.drop(seq.seq_id)
        sched.num_preemptions += 1
        if p.mode == "swap":
            seq.status = SeqStatus.SWAPPED
            sched.num_swapped_out += 1
            insert(sched.swapped, seq)
        else:
            seq.status = SeqStatus.WAITING
            seq.num_computed = 0
            insert(sched.waiting, seq)
    for seq_id in result.resumed:
        seq = sched.seqs[seq_id]
        sched.swapped.remove(seq)
        seq.status = SeqStatus.RUNNING
        insert(sched.running, seq)
