"""The memory simulation reproduces the shape of the PagedAttention profile on ShareGPT-like lengths."""
from pagedserve.benchmarks.kv import simulate
from pagedserve.benchmarks.workloads import sample_lengths


def test_paged_holds_token_state_and_contiguous_wastes_most():
    reqs = sample_lengths("sharegpt", 80, seed=1)
    kw = dict(kv_tokens=15700, block_size=16, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=4096)
    paged = simulate("paged", reqs, **kw)
    cmax = simulate("contiguous-max", reqs, **kw)
    oracle = simulate("contiguous-oracle", reqs, **kw)
    assert paged["token_state_fraction"] > 0.96
    assert paged["breakdown"]["external_fragmentation"] == 0
    assert cmax["token_state_fraction"] < 0.40
    assert cmax["max_running"] == 7  # 15700 // 2048 reservations
    assert paged["mean_running"] > 2 * cmax["mean_running"]
    assert oracle["mean_running"] > cmax["mean_running"]
    for r in (paged, cmax, oracle):
        assert abs(sum(r["breakdown"].values()) - 1) < 1e-9
        assert r["rejected"] == 0


def test_sliding_window_frees_blocks_and_runs_more():
    reqs = sample_lengths("sharegpt", 80, seed=1)
    kw = dict(kv_tokens=6000, block_size=16, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=4096)  # a small pool: memory limits the batch
    paged = simulate("paged", reqs, **kw)
    windowed = simulate("paged", reqs, window=256, **kw)
    assert paged["blocks_released"] == 0 and windowed["blocks_released"] > 0
    assert windowed["mean_running"] > paged["mean_running"]
    assert windowed["rejected"] == 0


def test_chats_with_a_host_tier_compute_what_it_restores_less():
    reqs = sample_lengths("sharegpt", 60, seed=2, max_total=1024)
    kw = dict(kv_tokens=2000, block_size=16, max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=2048, conversations=6)
    off = simulate("paged", reqs, **kw)
    on = simulate("paged", reqs, offload_blocks=128, **kw)
    tier = on["host_tier"]
    assert off["host_tier"] is None and off["rejected"] == on["rejected"] == 0
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert tier["restored"] == tier["hits"] > 0 and tier["offloaded"] > 0
    assert 0 < tier["hit_rate"] <= 1 and 0 < tier["occupancy"] <= 1
    assert tier["tokens_not_recomputed"] == tier["restored"] * 16
    assert on["tokens_computed"] == off["tokens_computed"] - tier["tokens_not_recomputed"]
    for r in (off, on):
        assert abs(sum(r["breakdown"].values()) - 1) < 1e-9
