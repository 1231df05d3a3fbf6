"""pagedserve.executor.prompt_logprobs.attach: prompt logprobs join a step's sampled outputs,
in place where every scored sequence samples, with prompt-only entries between them where
one does not."""
from pagedserve.executor.prompt_logprobs import attach
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import PromptLogprob, SampleOutput
from pagedserve.wire.step_outputs import StepOutputs

BS = 4
ONE, TWO = [PromptLogprob(3, -1.0, 2)], [PromptLogprob(4, -0.5, 1, [(4, -0.5)])]


def test_scored_rows_that_sample_take_their_entries_in_place():
    batch = batch_of([Seq("a", [1], 0, [0]), Seq("b", [1], 0, [1]), Seq("c", [1], 0, [2], sample=False)], BS)
    sampled = StepOutputs(["a", "b"], [5, 6], {0: SampleOutput("a", 5, -0.2)})
    out = attach(batch, sampled, {1: ONE})
    assert out is sampled and out.tokens == [5, 6]
    assert out == [SampleOutput("a", 5, -0.2), SampleOutput("b", 6, prompt_logprobs=ONE)]


def test_a_prompt_only_row_goes_between_in_batch_order():
    batch = batch_of([Seq("a", [1], 0, [0], sample=False), Seq("b", [1], 0, [1]),
                      Seq("c", [1], 0, [2], sample=False), Seq("d", [1], 0, [3])], BS)
    sampled = StepOutputs(["b", "d"], [-1, 6], {0: SampleOutput("b", -1, sampled=False, error="its grammar: x")})
    out = attach(batch, sampled, {0: ONE, 3: TWO})
    assert out.seq_ids == ["a", "b", "d"] and out.tokens == [-1, -1, 6] and sorted(out.more) == [0, 1, 2]
    assert out == [SampleOutput("a", -1, sampled=False, prompt_logprobs=ONE),
                   SampleOutput("b", -1, sampled=False, error="its grammar: x"),
                   SampleOutput("d", 6, prompt_logprobs=TWO)]
