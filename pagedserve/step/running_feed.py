"""The running set's feed (pagedserve.step.running_set): `fill` puts each fed token, the
sequence's last sample, in place just before the step runs; `record` keeps what the step
sampled, for the steps behind it. See pagedserve.wire.step_feed.

A step's outputs may still be on the device when the next step is filled
(pagedserve.wire.pending_outputs): its rows' tokens are then unsettled (`feed_src[row]`, the
entry of that pass's token tensor), and `fill` hands them to the device to read
(`StepBatch.device_feed`) unless the host needs them (token histories, rows left out),
where it waits for them (`settle`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedserve.step.step_batch import FLAG_HISTORY, FLAG_PROMPT_LOGPROBS
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.wire.step_feed import FED_UNKNOWN, FedTokenUnknown
from pagedserve.wire.step_outputs import StepOutputs

if TYPE_CHECKING:
    from pagedserve.step.running_set import Applied, RunningSet


def fill(rs: RunningSet, step: Applied) -> None:
    """Put each fed token in place (and in the token histories); FedTokenUnknown, before
    any change, for one this set does not hold. A sequence left out of an earlier step
    is left out of this one too, with the same reason."""
    fed, batch = step.fed, step.batch
    if not len(fed):
        return
    if rs.unsettled is not None and (rs.unsettled[0].done() or batch.errors or rs.left_out
                                     or batch.some_flags & (FLAG_HISTORY | FLAG_PROMPT_LOGPROBS)):
        settle(rs)
    if rs.left_out:
        out = [k for k, i in enumerate(fed) if batch.seq_ids[i] in rs.left_out]
        for k in out:
            i = int(fed[k])
            batch.errors[i] = f"left out of an earlier step: {rs.left_out[batch.seq_ids[i]]}"
            batch.token_ids[batch.starts[i]] = 0
        fed = np.delete(fed, out)
    if rs.fast and len(fed) == len(batch.token_ids) == batch.num_seqs:
        sel = at = slice(None)  # every row fed, one token each
    else:
        sel, at = fed, batch.starts[fed]
    rows = step.rows[sel]
    wrong = rs.last_pos[rows] != batch.start_pos[sel]
    if np.count_nonzero(wrong):
        i = int(fed[np.flatnonzero(wrong)[0]])
        raise FedTokenUnknown(f"{FED_UNKNOWN}: sequence {batch.seq_ids[i]!r} at position "
                              f"{batch.start_pos[i]}: send its token")
    tokens = rs.last_token[rows]
    batch.token_ids[at] = tokens
    if rs.unsettled is not None:
        src = rs.feed_src[rows]
        on_device = np.flatnonzero(src >= 0)
        if len(on_device):
            packed = on_device if isinstance(at, slice) else at[on_device]
            batch.device_feed = (rs.unsettled[0].tokens, packed, src[on_device])
    if batch.histories:
        for k in np.flatnonzero(batch.flags[fed] & FLAG_HISTORY):
            i = int(fed[k])
            token = int(tokens[k])
            batch.held[i].history[int(batch.start_pos[i])] = token
            prompt, output = batch.histories[i]
            (output if output else prompt)[-1] = token


def settle(rs: RunningSet) -> None:
    """The unsettled tokens on the host (waiting for them)."""
    pending, rows, entries = rs.unsettled
    rs.unsettled = None
    rs.last_token[rows] = np.asarray(pending.result().tokens, dtype=np.int64)[entries]
    rs.feed_src[rows] = -1


def record(rs: RunningSet, step: Applied, outputs) -> None:
    """Keep what the step sampled (`outputs`: one per row that reports, in order;
    pagedserve.wire.step_outputs, or pending: pagedserve.wire.pending_outputs)."""
    batch = step.batch
    if not outputs:
        return
    if rs.unsettled is not None:  # an earlier step's, older than this one's
        settle(rs)
    if rs.fast and step.decode:  # every row samples: every row reports
        everyone = True
    else:
        reports = batch.reports()
        everyone = rs.fast and np.count_nonzero(reports) == len(reports)
    reporting = None if everyone else np.flatnonzero(reports)
    at = slice(None) if everyone else reporting
    pending = isinstance(outputs, PendingOutputs)
    if not pending:
        outputs = StepOutputs.of(outputs)
    rows = step.rows[at]
    if everyone and step.owners == rs._owners and not batch.errors and not batch.some_flags & FLAG_PROMPT_LOGPROBS:
        keep = None  # every row sampled, and none changed hands since the step was made
    else:
        keep = batch.sample[at] & (rs.gen[rows] == step.gens[at])
    for k, error in ({} if pending else outputs.errors()).items():  # pending: none left out
        if keep is None:
            keep = np.ones(len(outputs), dtype=bool)
        keep[k] = False
        i = k if reporting is None else reporting[k]
        seq_id = batch.seq_ids[i]
        if seq_id in rs.row_of and rs.gen[rows[k]] == step.gens[i]:
            rs.left_out[seq_id] = error
            rs.last_pos[rows[k]] = -1
    ends = batch.start_pos[at] + batch.num_tokens[at]
    if keep is not None:
        entries = np.flatnonzero(keep)
        rows, ends = rows[entries], ends[entries]
    rs.last_pos[rows] = ends
    if pending:
        entries = np.arange(len(outputs)) if keep is None else entries
        rs.feed_src[rows] = outputs.start + entries
        rs.unsettled = (outputs, rows, entries)
    else:
        tokens = np.array(outputs.tokens, dtype=np.int64)
        rs.last_token[rows] = tokens if keep is None else tokens[entries]
