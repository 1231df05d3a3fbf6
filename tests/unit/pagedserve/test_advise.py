from pagedserve.advise import advise, load_shape


def test_opt_13b_on_a_40gb_accelerator_matches_the_hand_calculation():
    shape = load_shape("opt-13b")
    assert abs(shape.num_parameters / 1e9 - 12.85) < 0.05
    a = advise(shape, memory_gib=40, bandwidth_gbs=1555, tflops=312)
    assert a.kv_bytes_per_token == 800 * 1024  # 2 x 40 layers x 5120 x 2 bytes
    assert abs(a.kv_budget_bytes / (1 << 30) - 12) < 0.3  # about 12 GiB of KV
    assert 15_500 <= a.kv_tokens <= 15_900  # about 15.7K tokens
    assert a.contiguous_batch_ceiling == 7  # 2048-token reservations
    assert a.paged_batch_ceiling > 3 * a.contiguous_batch_ceiling


def test_low_concurrency_says_paging_buys_little():
    a = advise(load_shape("llama-3-8b"), memory_gib=80, bandwidth_gbs=3350, tflops=989,
               concurrency=2)
    assert a.binding == "per-token latency" and "buys little" in a.explanation


def test_weights_that_do_not_fit_are_refused():
    import pytest

    with pytest.raises(ValueError, match="do not fit"):
        advise(load_shape("llama-3-70b"), memory_gib=40, bandwidth_gbs=1555, tflops=312)
