"""Decode CUDA graphs: buckets, eligibility, and the static-buffer replay path, with an eager
stand-in for torch.cuda.CUDAGraph (no GPU here; the GPU run is scripts/gpu_check.py's)."""
import contextlib
import types

import torch

from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.executor.cuda_graphs import DecodeGraphs, bucket_for, buckets
from pagedserve.step.whole_seqs import Seq, batch_of

BLOCK = 64  # the tables' block size (the pool's is not read here): one block covers every position


def test_buckets():
    sizes = buckets(256)
    assert sizes[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and sizes[-1] == 256
    assert sizes == sorted(set(sizes))
    assert buckets(5) == [1, 2, 4, 5]
    assert bucket_for(3, sizes) == 4 and bucket_for(33, sizes) == 48 and bucket_for(257, sizes) is None


class EagerGraph:
    """Records the captured call and runs it again on replay."""

    current = None

    def __init__(self):
        self.fn = None

    def replay(self):
        self.fn()


def eager_capture(graph):
    @contextlib.contextmanager
    def cm():
        EagerGraph.current = graph
        yield
    return cm()


def batch(n, start=5):
    return batch_of([Seq(str(i), [10 + i], start + i, [i, i + 1] if i % 2 else [i]) for i in range(n)], BLOCK)


def test_replay_pads_to_the_bucket_and_returns_the_batch_rows():
    calls = []
    pool = torch.zeros(8, 1, 2, 4, 1, 2)

    def raw(input_ids, positions, meta):
        return torch.stack([input_ids.float(), positions.float(), meta.slot_mapping.float(),
                            meta.seq_lens.float(), meta.block_tables.float().sum(1)], 1)

    class Model:
        def __call__(self, input_ids, positions, meta, kv_pool):
            calls.append(len(input_ids))
            out = raw(input_ids, positions, meta)
            graph, EagerGraph.current = EagerGraph.current, None
            if graph is not None:  # being captured: replay recomputes from the static buffers
                graph.fn = lambda: out.copy_(raw(input_ids, positions, meta))
            return out

    graphs = DecodeGraphs(Model(), pool, AttentionMetadata, max_blocks=4, max_batch=8,
                          graph_cls=EagerGraph, capture=eager_capture, warmup=0)
    meta = AttentionMetadata.from_batch(batch(3))
    assert graphs.eligible(meta)
    hidden = graphs.run(meta).hidden
    assert calls == [4]  # captured once at bucket 4
    expected = raw(meta.input_ids, meta.positions, meta)
    assert torch.equal(hidden, expected)
    step = graphs.steps[4]
    assert step.slot_mapping[3] == -1 and step.seq_lens[3] == 1 and step.block_tables[3].sum() == 0
    meta2 = AttentionMetadata.from_batch(batch(2, start=40))
    hidden2 = graphs.run(meta2).hidden  # same bucket? 2 -> bucket 2: a new capture
    assert torch.equal(hidden2, raw(meta2.input_ids, meta2.positions, meta2))
    meta3 = AttentionMetadata.from_batch(batch(4, start=9))
    hidden3 = graphs.run(meta3).hidden  # bucket 4 again: replay over new inputs, no capture
    assert calls == [4, 2] and graphs.replays == 3
    assert torch.equal(hidden3, raw(meta3.input_ids, meta3.positions, meta3))


def test_prefill_and_oversized_steps_are_not_eligible():
    pool = torch.zeros(8, 1, 2, 4, 1, 2)
    graphs = DecodeGraphs(lambda *a: None, pool, AttentionMetadata, max_blocks=1, max_batch=2,
                          graph_cls=EagerGraph, capture=eager_capture)
    prefill = batch_of([Seq("a", [1, 2], 0, [0])], BLOCK)
    assert not graphs.eligible(AttentionMetadata.from_batch(prefill))
    assert not graphs.eligible(AttentionMetadata.from_batch(batch(3)))  # past the largest bucket
    assert not graphs.eligible(AttentionMetadata.from_batch(batch(2)))  # a table wider than captured
    assert DecodeGraphs.for_pool(None, None, pool) is None  # CPU pool: no graphs


def test_capture_all_captures_every_bucket_once_before_any_step():
    calls = []
    pool = torch.zeros(8, 1, 2, 4, 1, 2)

    def model(input_ids, positions, meta, kv_pool):
        calls.append(len(input_ids))
        EagerGraph.current.fn = lambda: None
        return torch.zeros(len(input_ids), 1)

    graphs = DecodeGraphs(model, pool, AttentionMetadata, max_blocks=4, max_batch=8,
                          graph_cls=EagerGraph, capture=eager_capture, warmup=0)
    graphs.run(AttentionMetadata.from_batch(batch(3)))  # bucket 4, captured on first use
    assert graphs.capture_all(progress=False) == 3 and calls == [4, 1, 2, 8]
    assert sorted(graphs.steps) == graphs.sizes == [1, 2, 4, 8]
    assert graphs.capture_all(progress=False) == 0 and calls == [4, 1, 2, 8]


class Replayable:
    """A real model under the eager stand-in: a captured call is computed again on replay."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, positions, meta, kv_pool):
        out = self.model(input_ids, positions, meta, kv_pool)
        graph, EagerGraph.current = EagerGraph.current, None
        if graph is not None:
            graph.fn = lambda: out.copy_(self.model(input_ids, positions, meta, kv_pool))
        return out


def test_the_runner_counts_replayed_and_eager_steps_and_samples_as_without_graphs(tmp_path):
    from pagedserve.executor.metrics import GraphSteps
    from prometheus_client import CollectorRegistry
    from tests.unit.executor.test_device_wait import chunked_prefill, make_runner

    plain, graphed = make_runner(tmp_path), make_runner(tmp_path)
    graphed.model.load_state_dict(plain.model.state_dict())
    graphed.graphs = DecodeGraphs(Replayable(graphed.model), graphed.kv_pool, AttentionMetadata,
                                  max_blocks=8, max_batch=4, graph_cls=EagerGraph, capture=eager_capture, warmup=0)
    graphed.graphs.capture_all(progress=False)
    for runner in (plain, graphed):
        runner.outs = [runner.execute(b) for b in chunked_prefill()]
    assert [list(o.tokens) for o in graphed.outs] == [list(o.tokens) for o in plain.outs]
    assert graphed.graph_counts() == (1, 2)  # the decode step; both prompt chunks

    class Executor:
        def graph_counts(self):
            return graphed.graph_counts()

    registry = CollectorRegistry()
    GraphSteps(Executor(), registry)
    assert registry.get_sample_value("pagedserve:execute_graph_replays_total") == 1
    assert registry.get_sample_value("pagedserve:execute_eager_steps_total") == 2


class HeadGraphs(DecodeGraphs):
    """The eager stand-in for graphs that go on through the LM head: a replay runs the
    captured step again over its static buffers."""

    def _capture(self, step):
        self._forward(step)
        step.graph = types.SimpleNamespace(replay=lambda: self._forward(step))


def test_a_graph_through_the_lm_head_hands_the_sampler_its_logits_and_greedy_tokens(tmp_path, monkeypatch):
    from pagedserve.executor.sampler import Sampler
    from pagedserve.wire.protocol import SamplingParams
    from tests.unit.executor.test_device_wait import make_runner

    plain, graphed = make_runner(tmp_path), make_runner(tmp_path)
    graphed.model.load_state_dict(plain.model.state_dict())
    graphed.graphs = HeadGraphs(graphed.model, graphed.kv_pool, AttentionMetadata, max_blocks=8, max_batch=4,
                                warmup=0, head=graphed.model.compute_logits, vocab_size=graphed.config.vocab_size)
    greedy_given = []
    sample = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, *a, greedy=None, **kw: (
        greedy_given.append(greedy is not None), sample(self, *a, greedy=greedy, **kw))[1])
    drawn = SamplingParams(temperature=0.7, top_k=5)
    prompts = {"a": [3, 4, 5, 6, 7], "b": [9, 8, 7], "c": [11, 12, 13, 14, 15, 16]}
    tables = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    steps = [[Seq(s, p, 0, tables[s]) for s, p in prompts.items()],
             [Seq(s, [20 + k], len(p), tables[s]) for k, (s, p) in enumerate(prompts.items())],
             [Seq(s, [30 + k], len(p) + 1, tables[s], sampling=drawn if s == "b" else SamplingParams(temperature=0.0),
                  seed=5) for k, (s, p) in enumerate(prompts.items())]]
    for runner in (plain, graphed):
        runner.outs = [list(runner.execute(batch_of(seqs, 4))) for seqs in steps]
    assert graphed.outs == plain.outs
    assert graphed.graph_counts() == (2, 1)  # both decode steps; the prompts
    assert greedy_given == [False, False, False, False, True, True]  # the graphed decode steps offer their argmax
    step = graphed.graphs.steps[4]
    assert step.logits.data_ptr() == graphed.graphs.logits.data_ptr()  # one logits buffer for every bucket
