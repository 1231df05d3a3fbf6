"""How a sequence leaves the scheduler. `abort` stops one (a request's, or a sample alone),
`drop` forgets one that ended, `release` takes a running one off the device to recompute,
`fail_alone` ends one the executor left out or whose output could not be applied (its
request gets an error update, the others go on). memsvc frees their blocks at the next
reserve (`Scheduler.to_free`). `remove` is the one place a sequence leaves `Scheduler.seqs`:
while `Scheduler.removals` stays, every sequence found there once is still there. See
docs/ARCHITECTURE.md, "One step"."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.gateway.seq_update import SeqUpdate
from pagedserve.gateway.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from pagedserve.gateway.scheduler import Scheduler


def abort(sched: Scheduler, seq_id: str, reason: str = "abort") -> Sequence | None:
    """Stop a sequence; its blocks are freed by the next reserve."""
    seq = sched.seqs.get(seq_id)
    if seq is None:
        return None
    drop(sched, seq)
    sched.holds.drop(seq_id)
    end_held(sched, seq_id, reason)
    if seq.status is not SeqStatus.FINISHED:
        seq.finish(reason)
    return seq


def abort_request(sched: Scheduler, request_id: str, reason: str = "abort") -> None:
    for seq_id in [s.seq_id for s in sched.seqs.values() if s.request_id == request_id]:
        abort(sched, seq_id, reason)
    sched.beams.pop(request_id, None)


def drop(sched: Scheduler, seq: Sequence) -> None:
    """Forget a sequence; memsvc frees its blocks at the next reserve."""
    for queue in (sched.waiting, sched.running, sched.swapped):
        if seq in queue:
            queue.remove(seq)
    remove(sched, seq.seq_id)
    if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
        sched.to_free.append(seq.seq_id)


def release(sched: Scheduler, seq: Sequence) -> None:
    """Take a running sequence off the device: memsvc frees its blocks at the next
    reserve; it is WAITING, to be recomputed once queued again (`Scheduler.enqueue`)."""
    sched.running.remove(seq)
    sched.to_free.append(seq.seq_id)
    seq.status, seq.num_computed = SeqStatus.WAITING, 0


def fail_alone(sched: Scheduler, seq: Sequence | None, source, why: Exception | str) -> None:
    """End `seq` alone: the executor left it out (`why` its reason), or applying its output
    raised `why`; its request gets an error update naming it."""
    if seq is None or source is not None and source is not seq:  # ended already
        return
    if isinstance(why, str):
        error = f"the executor refused this sequence: {why}"
        sched.left_out.append(seq.seq_id)
    else:
        error = f"the gateway could not apply this sequence's output: {type(why).__name__}: {why}"
    abort(sched, seq.seq_id, "error")
    seq.error = error
    sched.failed_alone.append(SeqUpdate(seq, None, finished=True, error=error))


def remove(sched: Scheduler, seq_id: str) -> None:
    """Take a sequence out of `seqs` (the one place: while `removals` stays, every
    sequence found in `seqs` once is still there)."""
    del sched.seqs[seq_id]
    sched.removals += 1


def end_held(sched: Scheduler, parent_id: str, reason: str, error: str | None = None) -> None:
    """The samples a parent holds end with it, before they fork."""
    for sample in sched.holds.take(parent_id):
        if sample.seq_id in sched.seqs:
            remove(sched, sample.seq_id)
        sample.finish(reason, error)
