"""Piecewise CUDA graphs for prompt steps (pagedserve.executor.piecewise_graphs) on the CPU, with
a stand-in for the graphs: a bucket's pieces replay its captured forward over the same static
buffers, on a thread that stops at each split while the runner's eager attention runs, as the
pieces stop between replays. The capture splits once per layer; prompt and mixed steps give
the eager forward's logits; a bucket whose check fails is dropped and its steps run eagerly."""
import threading
import types
from dataclasses import replace

import torch

from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.executor.piecewise_graphs import PiecewiseGraphs, token_buckets
from tests.support.tiny_models import paged_batches
from pagedserve.executor.model_loader import load_model
from pagedserve.executor.model_runner import ModelRunner
from tests.support.tiny_models import make_tiny_model

MAX_TOKENS = 48
BLOCKS = 40


def make_runner(path):
    make_tiny_model(path, "llama3")
    model, config = load_model(str(path))
    return ModelRunner(model, config, torch.zeros(BLOCKS, config.num_layers, 2, 4, config.num_kv_heads, config.head_dim))


class NoGraph:
    def capture_begin(self, pool=None):
        pass

    def capture_end(self):
        pass


class _Replay:
    """One run of a bucket's captured forward, piece by piece."""

    def __init__(self, graphs, b):
        self.graphs, self.b = graphs, b
        self.go, self.stopped = threading.Semaphore(0), threading.Semaphore(0)

    def piece(self, i: int) -> None:
        if i == 0:
            threading.Thread(target=self.forward, daemon=True).start()
        else:
            self.go.release()
        assert self.stopped.acquire(timeout=60)

    def forward(self):
        g, b = self.graphs, self.b

        def split(q, *attention):
            g.q[:b.size].copy_(q)
            self.stopped.release()
            self.go.acquire()
            return g.o[:b.size]

        meta = g._meta(b.size, b.input_ids, b.positions, b.slot_mapping)
        with torch.inference_mode():
            b.hidden.copy_(g.model(b.input_ids, b.positions, replace(meta, split=split), g.kv_pool))
        self.stopped.release()


class ThreadedPieces(PiecewiseGraphs):
    def _capture(self, b):
        super()._capture(b)
        n = len(b.pieces)

        def piece(i):
            if i == 0:
                b.run = _Replay(self, b)
            b.run.piece(i)

        b.pieces = [types.SimpleNamespace(replay=lambda i=i: piece(i)) for i in range(n)]


def steps():
    """Prompts alone, prompts beside decodes, then a step past the largest bucket."""
    chunks = [[("a", list(range(3, 20))), ("b", list(range(40, 45)))],
              [("a", [7]), ("b", list(range(60, 90))), ("c", [5, 6, 7])],
              [("a", [8]), ("b", [9]), ("c", list(range(100, 160)))]]
    return list(paged_batches(chunks, block_size=4, num_blocks=BLOCKS))


def pieced(tmp_path, cls=ThreadedPieces):
    plain, runner = make_runner(tmp_path / "plain"), make_runner(tmp_path / "pieced")
    runner.model.load_state_dict(plain.model.state_dict())
    runner.pieces = cls(runner.model, runner.kv_pool, AttentionMetadata, MAX_TOKENS, graph_cls=NoGraph)
    return plain, runner


def test_token_buckets():
    assert token_buckets() == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets(100) == [16, 32, 48, 64, 96, 100] and token_buckets(16) == [16]


def test_prompt_steps_replayed_in_pieces_give_the_eager_logits(tmp_path):
    plain, runner = pieced(tmp_path)
    assert runner.capture_graphs(progress=False) == len(token_buckets(MAX_TOKENS))
    b = runner.pieces.buckets[16]
    layers = runner.config.num_layers
    assert len(b.pieces) == layers + 1 and len(b.splits) == layers  # split at each layer's attention
    assert all(s[2] == runner.config.attn_scale for s in b.splits)
    assert runner.pieces.q.shape[0] == MAX_TOKENS
    for batch_plain, batch in zip(steps(), steps()):
        want, got = plain.logits(batch_plain), runner.logits(batch)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.graph_counts() == (2, 1)  # 22 and 34 tokens in pieces; 62 past the largest bucket


def test_a_bucket_whose_check_fails_is_dropped_and_its_steps_run_eagerly(tmp_path, caplog):
    class Wrong(ThreadedPieces):
        def _replay(self, b, meta):
            return super()._replay(b, meta) + (1.0 if b.size == 32 else 0.0)

    plain, runner = pieced(tmp_path, Wrong)
    runner.capture_graphs(progress=False)
    assert runner.pieces.dropped == {32} and 32 not in runner.pieces.buckets
    assert "disagrees with the eager forward" in caplog.text
    for batch_plain, batch in zip(steps()[:2], steps()[:2]):
        torch.testing.assert_close(runner.logits(batch), plain.logits(batch_plain), rtol=1e-4, atol=1e-4)
    assert runner.graph_counts() == (1, 1)  # 22 tokens: bucket 32, dropped; 34: bucket 48


def test_no_pieces_on_a_cpu_pool_or_for_a_model_that_reads_the_device_on_the_host(tmp_path):
    runner = make_runner(tmp_path)
    assert runner.pieces is None  # a CPU pool
    model = types.SimpleNamespace(cuda_graph_safe=False)
    assert PiecewiseGraphs.for_pool(model, torch.zeros(1, 1, 2, 4, 1, 2)) is None


def test_a_capture_that_fails_leaves_no_capture_open_and_its_steps_run_eagerly(tmp_path, caplog):
    ended = []

    class Counted(NoGraph):
        def capture_begin(self, pool=None):
            ended.append(False)

        def capture_end(self):
            ended[-1] = True

    class Failing(ThreadedPieces):
        def _capture(self, b):
            self.failing = b.size == self.failing_size
            try:
                super()._capture(b)
            finally:
                self.o = self.o if self.o is not None else self.kept

        def _begin(self):
            graph = super()._begin()
            if self.failing and len(ended) > 1:  # the second piece has begun: its split fails
                self.failing, self.kept, self.o = False, self.o, None
            return graph

    plain, runner = pieced(tmp_path, Failing)
    runner.pieces.graph_cls = Counted
    batch = steps()[0]  # 22 tokens: bucket 32, captured on first use, here: it fails
    runner.pieces.sizes = [32]
    runner.pieces.failing_size = 32
    torch.testing.assert_close(runner.logits(batch), plain.logits(steps()[0]), rtol=1e-4, atol=1e-4)
    assert runner.pieces.dropped == {32} and len(ended) == 2 and all(ended)  # the piece open at the failure closed
    assert "its capture failed" in caplog.text and runner.graph_counts() == (0, 1)
