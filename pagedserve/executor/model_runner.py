"""One step of the model over the shared KV pool: forward, then sampling."""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.executor.cuda_graphs import DecodeGraphs, Replayed
from pagedserve.executor.device_wait import wait_for_device
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.piecewise_graphs import PiecewiseGraphs
from pagedserve.executor.prompt_logprobs import PromptScoring, attach
from pagedserve.executor.sampler import Sampler
from pagedserve.executor.seq_screen import run_screened, screen
from pagedserve.executor.staging import Staging
from pagedserve.kernels import copy_blocks
from pagedserve.step.step_batch import StepBatch
from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.pending_outputs import PendingOutputs
from pagedserve.wire.step_outputs import StepOutputs


class ModelRunner:
    """Runs StepBatches (pagedserve.step.step_batch) on `model` with its KV in `kv_pool`.

    kv_pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size] in `kv_dtype`
    (--kv-cache-dtype; None: the model's dtype), allocated by memsvc. Each sequence's tokens are computed at positions
    start_pos.., their K/V written to `slot_mapping` (slot = block * block_size + offset),
    and attention reads the context through its row of `block_tables`. `holds_pool`: this process holds
    the pool itself (a tensor-parallel rank on another node), so it applies each step's
    block copies first (StepBatch.copies; memsvc copies the pools it holds).
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, kv_pool: torch.Tensor,
                 holds_pool: bool = False, kv_dtype: torch.dtype | None = None):
        self.model = model
        self.kv_dtype = kv_dtype or model.dtype
        self.config = config
        self.sampler = Sampler(config.eos_token_ids)
        self.guided = None  # pagedserve.executor.logits_mask.GuidedDecoding: grammar masks (structured output)
        self.held_readback = False  # a CPU's launched outputs kept pending until asked (pagedserve.executor.readback)
        self.kv_pool = None
        self.attach_pool(kv_pool, holds_pool)

    def attach_pool(self, kv_pool: torch.Tensor, holds_pool: bool = False) -> None:
        c = self.config
        expected = (c.num_layers, 2, None, c.num_kv_heads, c.head_dim)
        shape = tuple(kv_pool.shape)
        if len(shape) != 6 or any(e is not None and e != s for e, s in zip(expected, shape[1:])):
            raise ValueError(
                f"KV pool shape {list(shape)} does not fit the model: expected "
                f"[num_blocks, {c.num_layers}, 2, block_size, {c.num_kv_heads}, {c.head_dim}]"
            )
        if kv_pool.dtype != self.kv_dtype:
            raise ValueError(f"KV pool dtype {kv_pool.dtype} differs from the configured KV cache's "
                             f"{self.kv_dtype} (--kv-cache-dtype; auto: the model's "
                             f"{self.model.dtype}): allocate the pool in that dtype or set --kv-cache-dtype")
        self.kv_pool, self.holds_pool = kv_pool, holds_pool
        self.staging = Staging(kv_pool.device)
        self.graphs = DecodeGraphs.for_pool(self.model, self.config, kv_pool)  # None on a CPU
        self.pieces = PiecewiseGraphs.for_pool(self.model, kv_pool)  # the other steps' (None on a CPU)
        self.eager_steps = 0  # run eagerly beside graphs

    @torch.inference_mode()
    def _hidden(self, batch: StepBatch, checked: bool = False
                ) -> tuple[torch.Tensor, AttentionMetadata, Replayed | None]:
        """The step's hidden states, its metadata, and a graph's outputs where one ran it."""
        pool = self.kv_pool
        if not checked:
            self._check(batch)
            if batch.errors:
                i = min(batch.errors)
                raise ValueError(batch.errors[i].split(": ", 1)[1])
        meta = AttentionMetadata.from_batch(batch, pool.device, self.staging)
        if batch.copies:
            self._copy(batch.copies)
        if self.graphs is not None and self.graphs.eligible(meta):
            replayed = self.graphs.run(meta)
            return replayed.hidden, meta, replayed
        if self.pieces is not None and self.pieces.eligible(meta):
            hidden = self.pieces.run(meta)
            if hidden is not None:
                return hidden, meta, None
        if self.graphs is not None or self.pieces is not None:
            self.eager_steps += 1
        hidden = self.model(meta.input_ids, meta.positions, meta, self.kv_pool)
        return hidden, meta, None

    def graph_counts(self) -> tuple[int, int]:
        """(steps CUDA graphs ran, steps run eagerly beside them)."""
        replays = sum(g.replays for g in (self.graphs, self.pieces) if g is not None)
        return replays, self.eager_steps

    def capture_graphs(self, progress: bool | None = None) -> int:
        """Capture every decode and prompt-step bucket now; the number captured."""
        return sum(g.capture_all(progress) for g in (self.graphs, self.pieces) if g is not None)

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        """Checked on every rank, so that all reject a bad batch alike; applied where this
        process holds its pool."""
        num_blocks = self.kv_pool.shape[0]
        if any(not (0 <= b < num_blocks) for pair in copies for b in pair):
            raise ValueError(f"a block copy {copies} names a block outside the pool's {num_blocks}")
        if self.holds_pool:
            copy_blocks(self.kv_pool, self.kv_pool, [c[0] for c in copies], [c[1] for c in copies])

    def _check(self, batch: StepBatch) -> None:
        """What each sequence must be to run: batch.errors names each one that is not. The
        others then run without them (a new batch), with their fed tokens read to the host."""
        screen(batch, self.config.vocab_size, self.kv_pool.shape[0], self.kv_pool.shape[3])
        if batch.errors and batch.device_feed is not None:
            tokens, at, src = batch.device_feed
            batch.token_ids[at] = tokens[torch.from_numpy(src).to(tokens.device)].cpu().numpy()
            batch.device_feed = None

    def execute(self, batch: StepBatch) -> StepOutputs:
        """One output (pagedserve.wire.step_outputs) per sequence that `reports` (samples, or
        scores prompt tokens: pagedserve.executor.prompt_logprobs), in batch order. A sequence
        whose tokens, slots, blocks or sampling parameters are out of range is left out of the
        pass and reports an error instead (pagedserve.executor.seq_screen). Returns only once the step's writes to the pool are
        done on the device (pagedserve.executor.device_wait)."""
        if not batch.num_seqs:
            raise ValueError("empty StepBatch")
        return run_screened(batch, self._check, self._execute)

    def launch(self, batch: StepBatch) -> StepOutputs | PendingOutputs:
        """`execute`, but the sampled tokens (and logprobs) may still be on their way to the
        host (pagedserve.wire.pending_outputs): where every sequence runs and no grammar or
        prompt logprobs need the host. The next step may be launched before they arrive."""
        if not batch.num_seqs:
            raise ValueError("empty StepBatch")
        return run_screened(batch, self._check, lambda b: self._execute(b, pending=True))

    @torch.inference_mode()
    def _execute(self, batch: StepBatch, pending: bool = False) -> StepOutputs | PendingOutputs:
        sampled = np.flatnonzero(batch.sample)
        if self.guided is not None:
            if batch.forget:
                self.guided.forget(batch.forget)
            self.guided.expect(batch)  # grammars compile from a sequence's first chunk on
        scoring = PromptScoring.of(batch, self.config.vocab_size)
        # grammar masks depend only on the tokens already known: computed during the forward pass
        masks = self.guided.prepare(batch, sampled) if self.guided is not None else None
        hidden, meta, replayed = self._hidden(batch, checked=True)
        outputs = StepOutputs([], [])
        if meta.sample_indices.numel():
            head = replayed if replayed is not None and replayed.logits is not None \
                and len(sampled) == batch.num_seqs else None  # the graph ran the LM head for every row
            logits = head.logits if head else self.model.compute_logits(hidden[meta.sample_indices])
            failed = self.guided.apply(logits, masks) if masks is not None else {}
            greedy = head.tokens if head and masks is None else None
            readback = self.sampler.sample(logits, batch, sampled, held=self.held_readback, greedy=greedy)
            if pending and scoring is None and not failed and not readback.done():
                return PendingOutputs(readback, 0, len(sampled))
            outputs = readback.outputs()
            for k, why in failed.items():
                outputs.put(k, SampleOutput(outputs.seq_ids[k], -1, sampled=False, error=f"its grammar: {why}"))
        if scoring is None:
            if not outputs:  # nothing was read back to the host, so nothing has waited yet
                wait_for_device(self.kv_pool.device)
            return outputs
        return attach(batch, outputs, scoring.run(self.model, hidden))

    @torch.inference_mode()
    def logits(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [T, vocab] of every token of the step, packed in batch order."""
        hidden, _, _ = self._hidden(batch)
        return self.model.compute_logits(hidden)
