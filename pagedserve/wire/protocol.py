"""The messages that cross service boundaries, as plain dataclasses.

These mirror the `pagedserve.v1` protocol. The gateway, memsvc and the executor exchange
only these (in process) or their protobuf twins (across processes), never each other's
internal objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)  # one per completion per step: slots make it cheaper to make
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
