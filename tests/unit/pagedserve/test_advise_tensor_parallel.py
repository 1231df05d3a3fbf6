"""`pagedserve advise --tensor-parallel-size N` (issue 29): a group has N accelerators' memory,
and its KV bytes count every rank's heads, replicated ones included."""
import pytest

from pagedserve.advise import advise, load_shape


def test_a_model_too_big_for_one_gpu_fits_a_group():
    shape = load_shape("llama-3-70b")
    with pytest.raises(ValueError, match="do not fit"):
        advise(shape, memory_gib=80, bandwidth_gbs=3350, tflops=989)
    a = advise(shape, memory_gib=80, bandwidth_gbs=3350, tflops=989, tensor_parallel=4)
    assert a.kv_bytes_per_token == shape.kv_bytes_per_token(2) and a.kv_tokens > 0


def test_replicated_kv_heads_cost_their_bytes():
    shape = load_shape("llama-3-70b")  # 8 KV heads
    eight = advise(shape, memory_gib=80, bandwidth_gbs=3350, tflops=989, tensor_parallel=8)
    sixteen = advise(shape, memory_gib=80, bandwidth_gbs=3350, tflops=989, tensor_parallel=16)
    assert sixteen.kv_bytes_per_token == 2 * eight.kv_bytes_per_token  # each KV head held twice


def test_a_size_that_cannot_split_the_kv_heads_names_the_numbers():
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 cannot split 8 KV heads"):
        advise(load_shape("llama-3-70b"), memory_gib=80, bandwidth_gbs=3350, tflops=989, tensor_parallel=3)
