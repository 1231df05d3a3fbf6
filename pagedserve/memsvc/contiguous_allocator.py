"""Contiguous baselines: one run of consecutive blocks per request, reserved up front.

Same pool, same block size, same block-table shape as `paged` (a run's block table is its
consecutive ids), so the same model code runs on it and the waste can be compared:
- contiguous-max: max(max_model_len, max_len) tokens, whatever the request asks;
- contiguous-pow2: the next power of two of max_len (prompt + max_tokens), capped at
  max_model_len (never below max_len);
- contiguous-oracle: exactly the sequence's final length (`final_len`; max_len if unknown).
Runs come from a first-fit RunAllocator, so external fragmentation arises as it would.
No prefix caching, no sharing (fork raises NotImplementedError), no swapping.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.memsvc.accounting import PoolSnapshot, contiguous_snapshot
from pagedserve.memsvc.admission import Admission, check_request, contiguous_admission
from pagedserve.memsvc.allocator import AppendResult, KVAllocator
from pagedserve.memsvc.block_pool import IntegrityError
from pagedserve.memsvc.block_table import blocks_for
from pagedserve.memsvc.run_allocator import Run, RunAllocator

CONTIGUOUS_POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class ContiguousSeq:
    seq_id: str
    run: Run
    max_len: int
    final_len: int | None = None
    num_tokens: int = 0
    synced: int = 0  # leading blocks of its table the gateway was told about

    def __post_init__(self) -> None:
        if self.final_len is not None and not 1 <= self.final_len <= self.max_len:
            raise ValueError(
                f"final_len must be in [1, max_len={self.max_len}], got {self.final_len}"
            )


class ContiguousAllocator(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int) -> None:
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"unknown contiguous policy {policy!r}; choose one of {CONTIGUOUS_POLICIES}")
        if block_size < 1 or max_model_len < 1:
            raise ValueError(
                f"block_size and max_model_len must be positive, got {block_size}, {max_model_len}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.max_model_len = max_model_len
        self.runs = RunAllocator(num_blocks)
        self._seqs: dict[str, ContiguousSeq] = {}

    def reservation_tokens(self, max_len: int, final_len: int | None = None) -> int:
        """Slots the policy reserves for a request of `max_len` tokens (prompt + max_tokens)."""
        if self.policy == "contiguous-max":
            return max(self.max_model_len, max_len)
        if self.policy == "contiguous-pow2":
            return max(min(next_pow2(max_len), self.max_model_len), max_len)
        return max_len if final_len is None else final_len

    def reservation_blocks(self, max_len: int, final_len: int | None = None) -> int:
        return blocks_for(self.reservation_tokens(max_len, final_len), self.block_size)

    def _get(self, seq_id: str) -> ContiguousSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    def admit(
        self,
        prompt_token_ids: list[int],
        max_len: int,
        salt: str | None = None,
        *,
        final_len: int | None = None,
        use_cache: bool = True,
    ) -> Admission:
        """`final_len` sizes the contiguous-oracle reservation (max_len when omitted)."""
        return contiguous_admission(
            prompt_len=len(prompt_token_ids),
            max_len=max_len,
            policy=self.policy,
            reservation_blocks=self.reservation_blocks(max_len, final_len),
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            largest_free_run=self.runs.largest_free_run(),
        )

    def add_sequence(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        *,
        max_len: int,
        final_len: int | None = None,
        salt: str | None = None,
        use_cache: bool = True,
    ) -> int:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already registered")
        check_request(len(prompt_token_ids), max_len)
        ContiguousSeq(seq_id, Run(0, 1), max_len, final_len)  # validate before allocating
        if final_len is not None and final_len < len(prompt_token_ids):
            raise ValueError(f"final_len {final_len} is shorter than the prompt")
        run = self.runs.allocate(self.reservation_blocks(max_len, final_len))  # NoFreeBlocks
        self._seqs[seq_id] = ContiguousSeq(seq_id, run, max_len, final_len)
        return 0

    def num_new_blocks(self, seq_id: str, num_new_tokens: int) -> int:
        """Always 0: the run was reserved at admission. ValueError if the tokens would
        overflow the reservation (the request outgrew what its policy reserved)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._get(seq_id)
        capacity = seq.run.length * self.block_size
        if seq.num_tokens + num_new_tokens > capacity:
            raise ValueError(
                f"sequence {seq_id!r} would hold {seq.num_tokens + num_new_tokens} tokens but"
                f" {self.policy} reserved {capacity} slots ({seq.run.length} blocks) for it"
            )
        return 0

    def append(self, seq_id: str, new_token_ids: list[int]) -> AppendResult:
        self.num_new_blocks(seq_id, len(new_token_ids))
        seq = self._seqs[seq_id]
        base = seq.run.start * self.block_size
        start, seq.num_tokens = seq.num_tokens, seq.num_tokens + len(new_token_ids)
        return AppendResult([base + p for p in range(start, seq.num_tokens)], [])

    def fork(self, parent_id: str, child_id: str) -> None:
        raise NotImplementedError(
            f"{self.policy} reserves one private run per request and cannot share blocks;"
            " fork (parallel sampling, beam search) needs the 'paged' policy"
        )

    def free(self, seq_id: str) -> None:
        seq = self._get(seq_id)
        self.runs.free(seq.run)
        del self._seqs[seq_id]

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def sequence_ids(self) -> list[str]:
        return list(self._seqs)

    def reserved_run(self, seq_id: str) -> Run:
        return self._get(seq_id).run

    def block_table(self, seq_id: str) -> list[int]:
        """The first ceil(num_tokens / block_size) blocks of the sequence's run."""
        seq = self._get(seq_id)
        return list(range(seq.run.start, seq.run.start + blocks_for(seq.num_tokens, self.block_size)))

    def num_tokens(self, seq_id: str) -> int:
        return self._get(seq_id).num_tokens

    def table_changes(self, seq_id: str) -> tuple[int, list[int]]:
        seq = self._get(seq_id)
        start, end = seq.synced, blocks_for(seq.num_tokens, self.block_size)
        seq.synced = end
        return start, list(range(seq.run.start + start, seq.run.start + end))

    def num_free_blocks(self) -> int:
        """All free blocks, in any run (a request may still need a longer run than exists)."""
        return self.runs.num_free

    def snapshot(self, next_request_blocks: int | None = None) -> PoolSnapshot:
        """External fragmentation: free blocks in runs shorter than `next_request_blocks`.
        None uses the reservation of the longest request the model allows (max_model_len
        tokens), so a free slot counts as usable only if any request could use it."""
        if next_request_blocks is None:
            next_request_blocks = self.reservation_blocks(self.max_model_len)
        return contiguous_snapshot(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            runs=[(s.run.length, s.num_tokens, s.final_len) for s in self._seqs.values()],
            free_runs=[r.length for r in self.runs.free_runs()],
            next_request_blocks=next_request_blocks,
        )

    def check_integrity(self) -> None:
        self.runs.check([s.run for s in self._seqs.values()])
        for s in self._seqs.values():
            if s.num_tokens > s.run.length * self.block_size:
                raise IntegrityError(
                    f"sequence {s.seq_id!r} holds {s.num_tokens} tokens in a run of"
                    f" {s.run.length} blocks"
                )
