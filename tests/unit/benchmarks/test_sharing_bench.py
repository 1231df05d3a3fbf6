"""`bench sharing`'s measurement of what forks save, on a few model-free requests."""
from pagedserve.benchmarks.sharing import parallel_sampling_saving
from pagedserve.benchmarks.workloads import BenchRequest


def test_parallel_sampling_saving_follows_the_prompt_share():
    requests = [BenchRequest(33, 16), BenchRequest(65, 32)]
    saved = [parallel_sampling_saving(requests, n, block_size=16, max_model_len=512) for n in (1, 2, 4)]
    assert saved[0] == 0.0 and 0 < saved[1] < saved[2] < 1
    # two samples of a long prompt with a short output: nearly half the blocks are saved
    long_prompt = parallel_sampling_saving([BenchRequest(1000, 8)], 2, block_size=16, max_model_len=2048)
    assert 0.45 < long_prompt < 0.5
