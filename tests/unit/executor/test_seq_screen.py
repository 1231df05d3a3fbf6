"""pagedserve.executor.seq_screen.run_screened: the sequences a check leaves out report their
error in their own place, the rest run without them, and the outputs stay columns."""
from pagedserve.executor.seq_screen import run_screened
from pagedserve.step.whole_seqs import Seq, batch_of
from pagedserve.wire.protocol import SampleOutput
from pagedserve.wire.step_outputs import StepOutputs

BS = 4


def test_left_out_rows_report_their_error_in_place_and_the_rest_keep_what_they_carry():
    batch = batch_of([Seq("a", [1], 0, [0]), Seq("bad", [1], 0, [1]), Seq("c", [1], 0, [2], sample=False),
                      Seq("d", [1], 0, [3])], BS)
    ran = []

    def check(b):
        b.errors.update({i: "ValueError: refused" for i, s in enumerate(b.seq_ids) if s == "bad"})

    def run(b):
        ran.append(list(b.seq_ids))
        return StepOutputs(["a", "d"], [5, 6], {1: SampleOutput("d", 6, -0.25)})

    out = run_screened(batch, check, run)
    assert ran == [["a", "c", "d"]]
    assert out.seq_ids == ["a", "bad", "d"] and out.tokens == [5, -1, 6] and sorted(out.more) == [1, 2]
    assert out == [SampleOutput("a", 5), SampleOutput("bad", -1, sampled=False, error="ValueError: refused"),
                   SampleOutput("d", 6, -0.25)]
    assert out.errors() == {1: "ValueError: refused"}


def test_without_errors_the_run_answers_in_columns_and_all_left_out_runs_nothing():
    batch = batch_of([Seq("a", [1], 0, [0]), Seq("b", [1], 0, [1])], BS)
    out = run_screened(batch, lambda b: None, lambda b: [SampleOutput("a", 5), SampleOutput("b", 6)])
    assert isinstance(out, StepOutputs) and out.tokens == [5, 6] and not out.more

    def refuse_all(b):
        b.errors.update({i: "ValueError: no" for i in range(b.num_seqs)})

    def run(b):
        raise AssertionError("a pass with no sequence left ran")

    out = run_screened(batch, refuse_all, run)
    assert out.tokens == [-1, -1] and out.errors() == {0: "ValueError: no", 1: "ValueError: no"}
