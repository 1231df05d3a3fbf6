"""The commands rank 0 of a tensor-parallel group sends its other ranks, as protobuf in tensors.

Contract:
- A command is (kind, payload): "execute" or "logits" with a StepBatch, "attach" with every
  rank's pool spec ((shared-memory name, shape, dtype), pagedserve.executor.tp_pools), "ping" and
  "stop" with None. It travels as a `TensorParallelCommand` (proto/pagedserve/wire/v1/tensor_parallel.proto):
  `send` broadcasts its length (one int64) and then its bytes (uint8) from rank 0; `receive`
  on every other rank reads them and parses that one message type. Nothing is pickled: the
  bytes a rank reads are data, never code, whoever wrote them to the group's connections.
- A command over MAX_COMMAND_BYTES is refused on rank 0 (ValueError) before anything is
  sent, so the other ranks are never left waiting for it.
- StepBatch <-> proto is exact, the sampling parameters too (doubles, 64-bit integers, one
  proto field per SamplingParams field, converted by name): every rank checks a sequence
  alike, so a sequence left out of the step is left out on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import dataclasses

import numpy as np

from pagedserve.rpc.grpc_service import MAX_MESSAGE_BYTES
from pagedserve.step.running_rows import columns_of, flags_of
from pagedserve.step.step_batch import FLAG_HISTORY, FLAG_PROMPT_LOGPROBS, Held, StepBatch
from pagedserve.wire.protocol import SamplingParams
from pagedserve.wire.v1.tensor_parallel_pb2 import (
    TensorParallelCommand,
    TensorParallelPing,
    TensorParallelPool,
    TensorParallelPools,
    TensorParallelSampling,
    TensorParallelSeq,
    TensorParallelStep,
    TensorParallelStop,
)

MAX_COMMAND_BYTES = MAX_MESSAGE_BYTES
STEP_KINDS = ("execute", "logits")


def sampling_to_proto(sp: SamplingParams) -> TensorParallelSampling:
    return TensorParallelSampling(**{f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)
                                     if getattr(sp, f.name) is not None})


def sampling_from_proto(m: TensorParallelSampling) -> SamplingParams:
    values = {}
    for fd in m.DESCRIPTOR.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            values[fd.name] = dict(getattr(m, fd.name))
        elif fd.is_repeated:
            values[fd.name] = list(getattr(m, fd.name))
        else:
            values[fd.name] = getattr(m, fd.name) if not fd.has_presence or m.HasField(fd.name) else None
    return SamplingParams(**values)


def step_to_proto(batch: StepBatch) -> TensorParallelStep:
    if batch.device_feed is not None:  # a group's outputs are never pending (Executor.launch)
        raise ValueError("a step whose fed tokens are on this device cannot travel to the other ranks")
    starts, tables, lens = batch.starts, batch.block_tables, batch.table_lens
    seqs = []
    for i, seq_id in enumerate(batch.seq_ids):
        a, b = starts[i], starts[i + 1]
        held = batch.held[i]
        seqs.append(TensorParallelSeq(
            seq_id=seq_id, token_ids=batch.token_ids[a:b].tolist(), start_pos=int(batch.start_pos[i]),
            slot_mapping=batch.slot_mapping[a:b].tolist(), block_table=tables[i, :lens[i]].tolist(),
            sample=bool(batch.sample[i]), sampling=sampling_to_proto(held.sampling), seed=held.seed,
            prompt_token_ids=batch.prompt_of(i), output_token_ids=batch.output_of(i),
            error=batch.errors.get(i, "")))
    return TensorParallelStep(seqs=seqs, pool_epoch=batch.pool_epoch, forget=batch.forget, step=batch.step,
                              copy_src=[c[0] for c in batch.copies], copy_dst=[c[1] for c in batch.copies])


def step_from_proto(m: TensorParallelStep) -> StepBatch:
    """The batch rank 0 sent, its columns made from the sequences' rows as they came."""
    held, histories, errors, tables = [], {}, {}, []
    for i, s in enumerate(m.seqs):
        sp = sampling_from_proto(s.sampling)
        flags = flags_of(sp)
        prompt, output = list(s.prompt_token_ids), list(s.output_token_ids)
        held.append(Held(s.seq_id, sp, s.seed, len(prompt), None,
                         prompt if flags & FLAG_PROMPT_LOGPROBS else None, flags))
        if flags & FLAG_HISTORY:
            histories[i] = (prompt, output)
        if s.error:
            errors[i] = s.error
        tables.append(list(s.block_table))
    lens = np.array([len(t) for t in tables], dtype=np.int32)
    block_tables = np.zeros((len(tables), int(lens.max()) if len(tables) else 0), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t

    def col(values, dtype):
        return np.array(values, dtype=dtype)

    temperature, top_k, top_p, min_p = zip(*(columns_of(h.sampling) for h in held)) if held else ((),) * 4
    return StepBatch(
        [s.seq_id for s in m.seqs], col([s.start_pos for s in m.seqs], np.int64),
        col([len(s.token_ids) for s in m.seqs], np.int64), col([t for s in m.seqs for t in s.token_ids], np.int64),
        col([s.sample for s in m.seqs], bool), col([t for s in m.seqs for t in s.slot_mapping], np.int64),
        block_tables, lens, held, col([h.flags for h in held], np.uint8),
        col(temperature, np.float32), col(top_k, np.int64), col(top_p, np.float32), col(min_p, np.float32),
        histories, errors, pool_epoch=m.pool_epoch, forget=list(m.forget), step=m.step,
        copies=list(zip(m.copy_src, m.copy_dst)))


def encode(kind: str, payload) -> TensorParallelCommand:
    """The command for (kind, payload) (ValueError for another kind)."""
    if kind in STEP_KINDS:
        return TensorParallelCommand(**{kind: step_to_proto(payload)})
    if kind == "attach":
        return TensorParallelCommand(attach=TensorParallelPools(pools=[
            TensorParallelPool(shm_name=name, shape=shape, dtype=dtype) for name, shape, dtype in payload]))
    if kind == "ping":
        return TensorParallelCommand(ping=TensorParallelPing())
    if kind == "stop":
        return TensorParallelCommand(stop=TensorParallelStop())
    raise ValueError(f"no tensor-parallel command {kind!r}")


def decode(command: TensorParallelCommand) -> tuple[str, object]:
    """(kind, payload) of a command (ValueError for one with nothing set)."""
    kind = command.WhichOneof("command")
    if kind in STEP_KINDS:
        return kind, step_from_proto(getattr(command, kind))
    if kind == "attach":
        return kind, [(p.shm_name, list(p.shape), p.dtype) for p in command.attach.pools]
    if kind in ("ping", "stop"):
        return kind, None
    raise ValueError("a tensor-parallel command with nothing in it")


def send(kind: str, payload, device: torch.device) -> None:
    """Broadcast the command from rank 0 (its length, then its bytes)."""
    data = encode(kind, payload).SerializeToString()
    if len(data) > MAX_COMMAND_BYTES:
        raise ValueError(f"a {len(data)}-byte tensor-parallel {kind} command is over the "
                         f"{MAX_COMMAND_BYTES}-byte limit")
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=device), src=0)
    if data:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=0)


def receive(device: torch.device) -> tuple[str, object]:
    """The next command rank 0 sends, as (kind, payload)."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if not 0 <= n <= MAX_COMMAND_BYTES:
        raise ValueError(f"rank 0 announced a {n}-byte tensor-parallel command")
    data = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        dist.broadcast(data, src=0)
    return decode(TensorParallelCommand.FromString(data.cpu().numpy().tobytes()))
