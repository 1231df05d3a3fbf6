"""A request taken in: checked (RequestError naming the field to change; nothing queued then),
turned into its sequences (n samples, or one beam search) and handed to the scheduler, with the
state its deltas will need (`RequestState`). Giving back is pagedserve.gateway.requests.
See docs/ARCHITECTURE.md, "The three services".
"""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.gateway.beam_search import BeamSearch, beam_sampling
from pagedserve.gateway.output_stream import OutputStream
from pagedserve.gateway.sequence import Sequence
from pagedserve.wire import convert
from pagedserve.wire.protocol import ModelInfo, SamplingParams

if TYPE_CHECKING:
    from pagedserve.gateway.requests import Requests


class RequestError(ValueError):
    """A request the gateway refuses; the message names the field to change."""


def derive_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class RequestState:
    request_id: str
    prompt_len: int
    seqs: list[Sequence]
    streams: list[OutputStream]
    open: set[int] = field(default_factory=set)
    sampling: SamplingParams | None = None  # as the request asked


def add(self: Requests, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        *, priority: int = 0, final_len: int | None = None, salt: str | None = None,
        arrival: float | None = None) -> None:
    """Check and queue a request; RequestError naming the bad field."""
    if request_id in self.by_id:
        raise RequestError(f"request_id {request_id!r} is already in use")
    _validate(self.info, prompt_token_ids, sampling)
    if salt is not None:  # it travels to memsvc in every plan that admits the request
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"cache_salt is not valid UTF-8 text: {e.reason} at {e.start}") from None
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
    max_len = min(len(prompt_token_ids) + sampling.max_tokens, self.info.max_model_len)
    arrival = time.monotonic() if arrival is None else arrival
    state = RequestState(request_id, len(prompt_token_ids), [], [], sampling=sampling)
    for i in range(sampling.n):
        state.streams.append(OutputStream(self.tokenizer, prompt_token_ids, sampling.stop,
                                          sampling.min_tokens))
        state.open.add(i)
    if sampling.beam_search:
        _add_beam_search(self, state, list(prompt_token_ids), sampling, seed, max_len, arrival,
                              priority, final_len, salt)
    else:
        for i in range(sampling.n):
            state.seqs.append(Sequence(f"{request_id}/{i}", request_id, i, list(prompt_token_ids),
                                       sampling, derive_seed(seed, i), max_len, arrival, priority,
                                       final_len, salt))
        self.scheduler.add(state.seqs[0], state.seqs[1:])
    self.by_id[request_id] = state


def _add_beam_search(self: Requests, state: RequestState, prompt: list[int], sampling: SamplingParams,
                     seed: int, max_len: int, arrival: float, priority: int,
                     final_len: int | None, salt: str | None) -> None:
    eos = set(self.info.eos_token_ids)
    stop_ids = set(sampling.stop_token_ids)

    def is_stop(token: int) -> bool:
        return token in stop_ids or (not sampling.ignore_eos and token in eos)

    seq_id = f"{state.request_id}/b0"
    search = BeamSearch(sampling, seq_id, max_new_tokens=max_len - len(prompt), is_stop=is_stop,
                        num_eos=len(eos))
    seq = Sequence(seq_id, state.request_id, 0, prompt, beam_sampling(sampling, search.num_candidates),
                   seed, max_len, arrival, priority, final_len, salt)
    state.seqs.append(seq)
    self.scheduler.add_beam_search(seq, search)


def _validate(info: ModelInfo, prompt: list[int], sampling: SamplingParams) -> None:
    if not prompt:
        raise RequestError("prompt is empty: send at least one token")
    if len(prompt) >= info.max_model_len:
        raise RequestError(
            f"prompt has {len(prompt)} tokens; the model's maximum length is "
            f"{info.max_model_len}, which must leave room for at least one new token"
        )
    bad = [t for t in prompt if not 0 <= t < info.vocab_size]
    if bad:
        raise RequestError(f"prompt_token_ids: {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
    bad = [t for t in sampling.logit_bias if t >= info.vocab_size]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})")
    try:
        sampling.validate(info.max_model_len)
    except ValueError as e:
        raise RequestError(str(e)) from None
    try:  # what the executor will receive (float32, the proto's integer widths) is valid too
        convert.sampling_from_proto(convert.sampling_to_proto(sampling)).validate()
    except (ValueError, TypeError) as e:
        raise RequestError(f"{e} (as the executor receives it: float32 and the wire's integer "
                           "types)") from None
