"""A step that samples nothing still waits for the device before it returns: memsvc copies
and swaps the step's blocks from another process as soon as the step is answered."""
import pytest
import torch

import pagedserve.executor.model_runner as model_runner
from pagedserve.executor.device_wait import wait_for_device
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from tests.support.tiny_models import make_tiny_model, paged_batches


@pytest.fixture
def syncs(monkeypatch):
    """The devices torch.cuda.synchronize was called for (CUDA mocked)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_wait_synchronizes_cuda_only(syncs):
    wait_for_device(torch.device("cuda", 1))
    assert syncs == [torch.device("cuda", 1)]
    wait_for_device(torch.device("cpu"))
    assert syncs == [torch.device("cuda", 1)]


def make_runner(tmp_path):
    make_tiny_model(tmp_path, "llama3")
    model, config = load_model(str(tmp_path))
    pool = torch.zeros(16, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)
    return ModelRunner(model, config, pool)


def chunked_prefill():
    """'a' prefills in two chunks (the first samples nothing), then decodes one token."""
    batches = list(paged_batches([[("a", list(range(3, 11)))], [("a", list(range(11, 17)))], [("a", [5])]],
                                 block_size=4, num_blocks=16))
    batches[0].sample[0] = False
    return batches


def test_a_step_that_samples_nothing_waits_for_the_device(tmp_path, monkeypatch):
    runner = make_runner(tmp_path)
    waits = []
    monkeypatch.setattr(model_runner, "wait_for_device", waits.append)
    middle, last, decode = chunked_prefill()
    assert runner.execute(middle) == []
    assert waits == [torch.device("cpu")]  # the pool's device; a no-op there
    assert len(runner.execute(last)) == 1 and len(runner.execute(decode)) == 1
    assert len(waits) == 1  # sampling read tokens back: it has waited already


def test_a_cpu_run_never_synchronizes_cuda(tmp_path, syncs):
    runner = make_runner(tmp_path)
    outs = [runner.execute(b) for b in chunked_prefill()]
    assert [len(o) for o in outs] == [0, 1, 1] and syncs == []
