"""A step's outputs in columns (pagedserve.wire.step_outputs): the columns, the rows they
stand for, and the wire both ways."""
from pagedserve.wire.protocol import PromptLogprob, SampleOutput
from pagedserve.wire.step_convert import outputs_from_proto, outputs_to_proto
from pagedserve.wire.step_outputs import StepOutputs


def test_plain_tokens_are_two_columns_and_read_as_rows():
    outs = StepOutputs(["a", "b"], [5, 6])
    assert not outs.more and len(outs) == 2
    assert list(outs) == [SampleOutput("a", 5), SampleOutput("b", 6)] == outs
    assert outs[1] == SampleOutput("b", 6) and outs[-1] == outs[1] and outs[:1] == [SampleOutput("a", 5)]
    assert StepOutputs.of(outs) is outs


def test_rows_that_carry_more_keep_it_and_their_token_stays_in_the_column():
    rows = [SampleOutput("a", 5), SampleOutput("b", 6, -0.5, [(6, -0.5)]),
            SampleOutput("c", -1, sampled=False, prompt_logprobs=[PromptLogprob(3, -1.0, 1)]),
            SampleOutput("d", -1, sampled=False, error="refused")]
    outs = StepOutputs.of(rows)
    assert outs.seq_ids == ["a", "b", "c", "d"] and outs.tokens == [5, 6, -1, -1]
    assert sorted(outs.more) == [1, 2, 3] and outs.errors() == {3: "refused"}
    assert list(outs) == rows


def test_the_wire_sends_tokens_alone_unless_a_row_carries_more():
    plain = outputs_to_proto(StepOutputs(["a", "b"], [5, 6]), "x")
    assert list(plain.tokens) == [5, 6] and not plain.outputs and plain.incarnation == "x"
    assert outputs_from_proto(plain, ["a", "b"]) == StepOutputs(["a", "b"], [5, 6])
    rows = [SampleOutput("a", 5, -0.25), SampleOutput("b", -1, sampled=False, error="refused")]
    rich = outputs_to_proto(rows)
    assert not rich.tokens and len(rich.outputs) == 2
    back = outputs_from_proto(type(rich).FromString(rich.SerializeToString()))
    assert list(back) == rows and back.errors() == {1: "refused"}
