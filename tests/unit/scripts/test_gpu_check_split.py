"""gpu_check's split part (scripts/gpu_check_split.py) without a GPU: its bench split commands
parse (in a process of its own: the rehearsal), --quick leaves it out saying so, and its summary keeps each kind's median run."""
import sys

from tests.support import ROOT

sys.path.insert(0, f"{ROOT}/scripts")
import gpu_check as gc  # noqa: E402
import gpu_check_split as gs  # noqa: E402


class Part:
    def __init__(self):
        self.result = {}

    def put(self, key, value):
        self.result[key] = value
        return value

    def over(self):
        return False


def test_its_bench_split_commands_parse_with_the_engine_settings_they_name(tmp_path):
    from pagedserve.cli import build_parser

    for name, run in gs.RUNS.items():
        args = build_parser().parse_args(gs.bench_split_argv(tmp_path / "m", "cuda", tmp_path / f"{name}.json",
                                                             run["requests"], run["max_seqs"], run["rounds"]))
        assert (args.num_requests, args.max_num_seqs, args.rounds) == (run["requests"], run["max_seqs"], run["rounds"])
        assert args.kv_memory == gs.KV_GIB and args.dtype == "bfloat16" and args.device == "cuda"


def test_quick_leaves_the_split_part_out(tmp_path):
    args = gc.parse_args(["--quick", "--parts", "split"])
    args.device = "cpu"
    assert gc.runners(args, tmp_path)["split"](Part()) == {"status": "skipped", "reason": "not run: --quick"}
    assert gc.DEFAULT_PARTS[-1] == "split" and gc.QUICK_BUDGETS["split"] == 0


def test_summary_keeps_the_median_run_of_each_kind():
    runs = {"in_process": [{"step_ms": 3.0}, {"step_ms": 1.0}, {"step_ms": 2.0}], "gateway": [{"step_ms": 5.0}]}
    result = {"runs": runs, "step_vs_in_process": {"gateway": 2.5}, "overhead_ms": {"gateway": 1.1},
              "gateway_vs_in_process": 0.4}
    assert gs.summary(result) == {"step_ms": {"in_process": 2.0, "gateway": 5.0}, "step_vs_in_process": {"gateway": 2.5},
                                  "overhead_ms": {"gateway": 1.1}, "gateway_vs_in_process": 0.4}
