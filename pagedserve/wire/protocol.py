"""The messages that cross service boundaries, as plain dataclasses.

These mirror the `pagedserve.v1` protocol. The gateway, memsvc and the executor exchange
only these (in process) or their protobuf twins (across processes), never each other's
internal objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.wire import sampling_fields
from pagedserve.wire.sampling_fields import DEFAULTS as _D
from pagedserve.wire.sampling_fields import (  # noqa: F401
    GUIDED_KINDS,
    MAX_BEAM_WIDTH,
    MAX_LOGPROBS,
    MAX_N,
)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Each field's type, range and default are declared
    once in pagedserve.wire.sampling_fields; `validate` names the field that is wrong."""

    max_tokens: int = _D["max_tokens"]
    temperature: float = _D["temperature"]
    top_p: float = _D["top_p"]
    top_k: int = _D["top_k"]  # 0 or -1: off
    min_p: float = _D["min_p"]
    repetition_penalty: float = _D["repetition_penalty"]
    presence_penalty: float = _D["presence_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    seed: int | None = _D["seed"]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = _D["ignore_eos"]
    # the executor masks the end-of-sequence and stop_token_ids tokens until this many output
    # tokens (unless nothing else is allowed: a grammar's end); stop strings match after it
    min_tokens: int = _D["min_tokens"]
    # token id -> a value in [-100, 100] added to its logit before anything else (OpenAI's)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = _D["logprobs"]  # None: no logprobs; 0: the chosen token's; k: plus the top k
    # per prompt position from the second on: None: none; 0: the prompt token's logprob and
    # rank; k: plus the top k (raw model distribution). Computing them disables prefix-cache hits
    prompt_logprobs: int | None = _D["prompt_logprobs"]
    n: int = _D["n"]  # completions; with beam search, the n best beams
    beam_width: int = _D["beam_width"]  # > 1: beam search (deterministic; temperature, top_*, seed unused)
    length_penalty: float = _D["length_penalty"]  # beam score = sum of logprobs / length ** length_penalty
    early_stopping: bool = _D["early_stopping"]  # True: stop once beam_width hypotheses finished
    # structured output: the executor masks every token the grammar does not allow
    # (pagedserve.executor.logits_mask); kind "" is off, else one of GUIDED_KINDS with its spec:
    # json_schema (the schema as JSON text), json_object (""), regex, choice (a JSON list of
    # strings), grammar (EBNF/GBNF text), structural_tag (xgrammar's, as JSON text)
    guided_kind: str = _D["guided_kind"]
    guided_spec: str = _D["guided_spec"]

    @property
    def guided(self) -> bool:
        return bool(self.guided_kind)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it (below 1e-5, as vLLM) that dividing by it overflows."""
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        """Penalties, a grammar or min_tokens: the executor needs the sequence's token
        history (a grammar's state is replayed from the output tokens, so it survives
        preemption, recompute, swap and forks; min_tokens counts them)."""
        return (
            self.guided
            or self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, max_model_len: int | None = None) -> None:
        """Raise ValueError (pagedserve.wire.sampling_fields.FieldError) naming the first invalid field."""
        for name in sampling_fields.FIELDS:
            sampling_fields.check(name, getattr(self, name))
        if max_model_len is not None and self.max_tokens > max_model_len:
            raise ValueError(
                f"max_tokens={self.max_tokens} exceeds the model's maximum length {max_model_len}"
            )
        if self.min_tokens > self.max_tokens:
            raise sampling_fields.FieldError("min_tokens", "", f"must be at most max_tokens ({self.max_tokens}), "
                                             f"got {self.min_tokens}")
        bound = sampling_fields.length_penalty_bound(max_model_len or 0)
        if abs(self.length_penalty) > bound:
            raise sampling_fields.FieldError(
                "length_penalty", "", f"must be between -{bound} and {bound} for a maximum length of "
                f"{max_model_len} tokens (length ** length_penalty must stay finite and nonzero "
                f"for every length up to it), got {self.length_penalty!r}")
        if self.beam_width > 1 and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with beam search")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(f"n={self.n} exceeds beam_width={self.beam_width}: beam search returns "
                             "at most beam_width completions")

    @property
    def beam_search(self) -> bool:
        return self.beam_width > 1


@dataclass
class KVGeometry:
    """Shape of the KV pool: block-major [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str = "float32"  # a torch dtype name
    # The sliding window every layer has (0: none): a position more than `window - 1` before
    # the next one to compute is read by no layer, so memsvc may free blocks wholly past it.
    window: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    @property
    def element_size(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_size)


@dataclass
class ModelInfo:
    """What the gateway needs to know about the executor's model."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    chat_template: str | None
    tokenizer_dir: str
    kv: KVGeometry
    aliases: list[str] = field(default_factory=list)  # other names it is served under (wire.served_names)
    max_num_seqs: int = 0  # the batch the executor is built for (on a GPU its largest CUDA graph's); 0: none


@dataclass
class PromptLogprob:
    """A prompt token's logprob under the model given the tokens before it, its rank (1: the
    most likely token) and the top k alternatives (token, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SampleOutput:
    """The output of one sequence of a step that reports (pagedserve.step.step_batch): a sampled token (unless `sampled` is False:
    a prompt chunk that samples nothing) and the prompt logprobs of the chunk's
    prompt_logprob_positions, for prompt positions start_pos + 1 on."""

    seq_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    sampled: bool = True
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    error: str = ""  # the sequence was left out of the step, for this reason: it ends alone


@dataclass
class PlanEntry:
    """A new sequence asking memsvc for slots: its whole prompt in `token_ids`; memsvc
    matches it against the prefix cache and grants up to `max_new_tokens` of the rest.
    (`new=False`: a running sequence's tokens, for in-process callers: Plan moves it into
    its columns.)"""

    seq_id: str
    token_ids: list[int]
    new: bool = True
    max_len: int = 0  # prompt + max_tokens, capped at the model maximum
    max_new_tokens: int = 0  # cap on the tokens granted this step
    final_len: int | None = None  # known final length, for measurement only
    salt: str | None = None
    skip_prefix_cache: bool = False  # attach no cached blocks (prompt logprobs need every
    # position computed); the blocks it computes are still cached for others


@dataclass
class Plan:
    """One step's request to memsvc, in priority order: the running sequences (swapped-out
    ones to resume among them) in columns, `run_ids[i]` computing the next `run_counts[i]`
    tokens of `run_tokens`, then the new ones in `entries`. In a plan made ahead
    (`ahead`), a running sequence's tokens may end with PENDING (pagedserve.wire.pending_token): the
    one the running step samples, its id named by a later plan's `fills`.
    `step_tokens` / `step_seconds` report the previous step (tokens computed, wall
    seconds of the executor's Execute): memsvc learns the cost of recompute from them.

    `ahead`: made while the executor still runs the previous step. memsvc then grants it
    only if that needs no block copy and no preemption (it would touch blocks the running
    step uses): otherwise it applies only `fills` and `free` and answers `deferred`, and
    the gateway plans again once the step is done. A plan made ahead carries no forks.
    `fills` (seq_id, position, token_id): the ids of tokens an earlier plan sent as
    PENDING, applied before anything else (prefix-cache keys of the blocks they complete).

    What the session's earlier steps did, settled before anything else (a block keyed by a
    Reserve is a prefix-cache hit only once its step is known to have run): `written`, the
    stamp (ReserveResult.stamp) of the last step that ran, every step reserved before it
    having run too; `void`, the steps reserved after it will never run (a step failed);
    `failed`, sequences left out of steps that ran (their writes did not happen)."""

    entries: list[PlanEntry] = field(default_factory=list)
    free: list[str] = field(default_factory=list)  # finished or cancelled: release their blocks first
    step_tokens: int = 0
    step_seconds: float = 0.0
    forks: list[tuple[str, str]] = field(default_factory=list)  # (parent, child), done before
    # anything else: the child shares every block of the parent (copy-on-write from here on)
    ahead: bool = False
    fills: list[tuple[str, int, int]] = field(default_factory=list)
    written: int = 0
    void: bool = False
    failed: list[str] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)
    run_counts: list[int] = field(default_factory=list)
    run_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        running = [e for e in self.entries if not e.new]
        if running:
            self.entries = [e for e in self.entries if e.new]
            for e in running:
                self.run_ids.append(e.seq_id)
                self.run_counts.append(len(e.token_ids))
                self.run_tokens.extend(e.token_ids)

    def seq_ids(self) -> list[str]:
        """Every sequence the plan asks for, in plan order."""
        return self.run_ids + [e.seq_id for e in self.entries]

    def empty(self) -> bool:
        return not (self.run_ids or self.entries or self.free or self.forks or self.fills)


class Grant(NamedTuple):
    """One sequence's grant, read out of Grants (tests and reports read them so)."""

    seq_id: str
    start_pos: int
    num_tokens: int
    table_start: int = 0
    new_blocks: list[int] = ()
    num_cached_tokens: int = 0


@dataclass
class Grants:
    """memsvc's grants in columns: sequence `seq_ids[i]` has slots for `num_tokens[i]`
    tokens from `start_pos[i]`, and its block table from index `table_start[i]` on is now
    its `num_new_blocks[i]` blocks of `new_blocks` (a new or resumed sequence: the whole
    table from 0; a decode step that fills no new block: nothing); `num_cached[i]`: prompt
    tokens a new sequence found in the prefix cache. The slot of position p is
    table[p // block_size] * block_size + p % block_size. The step message
    (pagedserve.wire.step_delta) takes these columns as they are."""

    seq_ids: list[str] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    table_start: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    num_cached: list[int] = field(default_factory=list)

    def add(self, seq_id: str, start: int, n: int, table_start: int, new_blocks: list[int],
            cached: int = 0) -> None:
        self.seq_ids.append(seq_id)
        self.start_pos.append(start)
        self.num_tokens.append(n)
        self.table_start.append(table_start)
        self.num_new_blocks.append(len(new_blocks))
        self.new_blocks.extend(new_blocks)
        self.num_cached.append(cached)

    def check(self) -> None:
        """ValueError where the columns do not agree in length."""
        lengths = {len(c) for c in (self.seq_ids, self.start_pos, self.num_tokens, self.table_start,
                                    self.num_new_blocks, self.num_cached)}
        if len(lengths) > 1 or sum(self.num_new_blocks) != len(self.new_blocks):
            raise ValueError("the grant columns (seq_ids, start_pos, num_tokens, table_start, "
                             "num_new_blocks, num_cached, new_blocks) do not agree")

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __iter__(self):
        at = 0
        for i, k in enumerate(self.num_new_blocks):
            yield Grant(self.seq_ids[i], self.start_pos[i], self.num_tokens[i], self.table_start[i],
                        self.new_blocks[at:at + k], self.num_cached[i])
            at += k

    def __getitem__(self, i: int) -> Grant:
        return list(self)[i]


@dataclass
class Preemption:
    seq_id: str
    mode: str  # "recompute" (blocks freed) or "swap" (blocks moved to host; resume later)


@dataclass
class Rejection:
    seq_id: str
    reason: str  # says which limit the request exceeds


@dataclass
class ReserveResult:
    grants: Grants = field(default_factory=Grants)
    preempted: list[Preemption] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # new sequences that fit later, not now
    resumed: list[str] = field(default_factory=list)  # swapped-out sequences back on the device
    pool_epoch: str = ""  # the pool the grants are in: new with every memsvc process
    deferred: bool = False  # a plan made ahead that memsvc did not grant (see Plan.ahead)
    # (src, dst) copy-on-write copies for ranks that hold their own pools (memsvc copied its
    # own already): they travel with this step to the executor (StepBatch.copies)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    stamp: int = 0  # names this Reserve in a later plan's `written`


@dataclass
class PoolStats:
    """memsvc's accounting: `snapshot` is pagedserve.memsvc.accounting's PoolSnapshot as a dict (slot
    counts; across the wire the fields of StatsResponse plus total_slots and
    token_state_fraction), `preemption` the swap/recompute counters and cost estimates
    (the preemption fields of StatsResponse)."""

    snapshot: dict = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_sequences: int = 0
    num_sessions: int = 0
    preemption: dict = field(default_factory=dict)


@dataclass
class Delta:
    """New output of one completion since the last delta: what the public API streams."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with the first token of each completion when sampling.prompt_logprobs is set: prompt
    # positions 1.. (position 0 has none)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
