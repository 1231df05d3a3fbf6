"""`--linear-backend auto` on a shared machine (pagedserve.executor.linear_auto), with injected timings:
a busy timing is taken again and never kept, a busy machine gets oneDNN, a kept plan is
checked once against an idle timing of its largest shape and of the others at M=64, a
planted stale plan is found and timed again, and MKL serves an M only where it wins clearly
at idle."""
import json
import logging

import pytest
import torch

from pagedserve.executor import linear_auto, linear_backend
from pagedserve.executor import linear_plan_cache as plan_cache
from pagedserve.executor.linear import Linear
from pagedserve.executor.linear_timing import Timing
from tests.unit.executor.test_linear_backend import needs_onednn

pytestmark = needs_onednn
ROWS = (1, 64)
BIG, SMALL = (48, 16), (24, 16)
US = 1e-6
# the plan, timed while other work ran: MKL ahead at M=64 (oneDNN 3,184 us, MKL 2,430)
STALE = {1: {"mkl": 40 * US, "onednn": 45 * US}, 64: {"mkl": 2430 * US, "onednn": 3184 * US}}
# the same day idle: oneDNN 1,060-1,134 us, MKL 1,849-1,911
IDLE = {1: {"mkl": 40 * US, "onednn": 45 * US}, 64: {"mkl": 1880 * US, "onednn": 1100 * US}}
# MKL ahead at one row by far, idle: a mixed plan
MIXED = {1: {"mkl": 20 * US, "onednn": 45 * US}, 64: {"mkl": 1880 * US, "onednn": 1100 * US}}


class FakeTimer:
    """time_shape's stand-in: `table` seconds for every shape, scaled by `scale`; the share
    of other work per call from `others` (then 0)."""

    def __init__(self, table, others=(), scale=1.0):
        self.table, self.others, self.scale, self.calls, self.rows = table, list(others), scale, [], []

    def __call__(self, layer, rows):
        self.calls.append(layer.shape)
        self.rows.append(rows)
        others = self.others.pop(0) if self.others else 0.0
        return Timing({m: {b: s * self.scale for b, s in self.table[m].items()} for m in rows}, 1.0, others)


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "path", lambda: str(tmp_path / plan_cache.FILE_NAME))
    monkeypatch.setattr(linear_auto, "RETRY_WAIT_S", 0)


@pytest.fixture
def timer(monkeypatch):
    def use(*args, **kwargs):
        fake = FakeTimer(*args, **kwargs)
        monkeypatch.setattr(linear_auto, "time_shape", fake)
        return fake
    return use


def plant(entries: dict, key=plan_cache.key) -> None:
    """A plan file as an earlier load would have left it."""
    with open(plan_cache.path(), "w") as f:
        json.dump({key(shape, torch.float32, ROWS): {str(m): t for m, t in seconds.items()}
                   for shape, seconds in entries.items()}, f)


def kept(shape):
    return plan_cache.load(plan_cache.key(shape, torch.float32, ROWS))


def plan_of_a_model():
    model = torch.nn.Sequential(Linear(torch.randn(*BIG)), Linear(torch.randn(*SMALL)))
    plan = {(c.out_features, c.in_features): c for c in linear_backend.configure(model, "auto", rows=ROWS)}
    assert all(layer.routes == plan[layer.shape].routes for layer in model)
    return plan


def test_a_planted_stale_plan_is_found_and_timed_again(timer, caplog):
    plant({BIG: STALE, SMALL: STALE})
    assert linear_auto.routes_from(STALE) == [(None, "mkl")]
    fake = timer(IDLE)
    with caplog.at_level(logging.WARNING, "pagedserve.executor"):
        plan = plan_of_a_model()
    assert fake.calls == [BIG, SMALL]  # the check's timing of BIG serves its decision
    for c in plan.values():
        assert c.routes == [(None, "onednn")] and c.source == "timed"
        assert "off at 48x16 (MKL kept at M=64, where oneDNN is now faster by more than 10%: 1100 us " \
               "against 1880)" in c.note
    assert kept(BIG) == IDLE and kept(SMALL) == IDLE
    assert any("kept timings were off" in r.getMessage() for r in caplog.records)


def test_a_kept_plan_that_agrees_is_checked_once_and_used(timer):
    plant({BIG: MIXED, SMALL: MIXED})
    fake = timer(MIXED, scale=1.2)  # the machine slower, the comparison alike
    plan = plan_of_a_model()
    assert fake.calls == [BIG, SMALL] and fake.rows == [ROWS, (64,)]
    for c in plan.values():
        assert c.routes == [(8, "mkl"), (None, "onednn")] and c.seconds == MIXED
        assert c.source == "cache" and c.note == "checked idle at 48x16, 24x16 at M=64"
    assert "kept from an earlier load" in linear_backend.summary(list(plan.values()))


def test_a_plan_spoiled_at_a_smaller_shape_is_found_though_the_largest_agrees(timer):
    """A contended minute can spoil one shape's comparison and not another's: each shape but
    the largest is checked at the decode batch's M."""
    plant({BIG: MIXED, SMALL: STALE})
    fake = timer(MIXED)
    plan = plan_of_a_model()
    assert fake.calls == [BIG, SMALL, SMALL] and fake.rows == [ROWS, (64,), ROWS]  # BIG's check serves
    for c in plan.values():
        assert c.routes == [(8, "mkl"), (None, "onednn")] and c.source == "timed"
        assert c.note.startswith("the kept timings were off at 24x16 (")
    assert kept(BIG) == MIXED and kept(SMALL) == MIXED


def test_a_busy_timing_is_taken_again_and_kept_once_idle(timer):
    fake = timer(MIXED, others=[0.5])
    plan = plan_of_a_model()
    assert fake.calls == [BIG, BIG, SMALL]
    assert all(c.source == "timed" and c.routes == [(8, "mkl"), (None, "onednn")] for c in plan.values())
    assert kept(BIG) == MIXED and kept(SMALL) == MIXED


def test_a_busy_machine_gets_onednn_keeps_nothing_and_times_no_more(timer, caplog):
    fake = timer(MIXED, others=[0.5, 0.5])
    with caplog.at_level(logging.WARNING, "pagedserve.executor"):
        plan = plan_of_a_model()
    assert fake.calls == [BIG, BIG]
    assert all(c.source == "busy" and c.routes == [(None, "onednn")] for c in plan.values())
    assert plan[BIG].seconds == MIXED and plan[SMALL].seconds == {}  # shown, not used
    assert "other work took 50%" in plan[BIG].note and "not timed" in plan[SMALL].note
    assert kept(BIG) is None and kept(SMALL) is None
    assert any("busy" in r.getMessage() and "nothing kept" in r.getMessage() for r in caplog.records)
    assert "2 shapes oneDNN, the machine busy" in linear_backend.summary(list(plan.values()))


def test_a_check_on_a_busy_machine_keeps_the_plan_and_says_so(timer):
    plant({BIG: MIXED})
    fake = timer(IDLE, others=[0.5, 0.5])
    plan = plan_of_a_model()
    assert fake.calls == [BIG, BIG]
    assert plan[BIG].source == "cache" and plan[BIG].routes == [(8, "mkl"), (None, "onednn")]
    assert plan[BIG].note.startswith("not checked: the machine was busy at 48x16")
    assert plan[SMALL].source == "busy" and plan[SMALL].routes == [(None, "onednn")]
    assert kept(SMALL) is None


def test_a_timing_again_on_a_busy_machine_leaves_the_other_shapes_kept_timings_in_use(timer, caplog):
    """The check finds the largest shape off and times it idle; the next shape, timed again,
    finds the machine busy: its kept timings (taken idle) serve, not oneDNN, and stay kept."""
    plant({BIG: STALE, SMALL: MIXED})
    fake = timer(IDLE, others=[0.0, 0.5, 0.5])
    with caplog.at_level(logging.WARNING, "pagedserve.executor"):
        plan = plan_of_a_model()
    assert fake.calls == [BIG, SMALL, SMALL]
    assert plan[BIG].source == "timed" and plan[BIG].routes == [(None, "onednn")] and kept(BIG) == IDLE
    assert plan[SMALL].source == "cache" and plan[SMALL].routes == [(8, "mkl"), (None, "onednn")]
    assert plan[SMALL].seconds == MIXED and kept(SMALL) == MIXED
    assert plan[SMALL].note.startswith("the kept timings serve (taken idle), timings not kept: other work took 50%")
    assert any("earlier load kept, else oneDNN" in r.getMessage() for r in caplog.records)


def test_timings_kept_before_the_idle_rule_are_not_used(timer):
    def old_key(*args):
        return plan_cache.key(*args).replace(f", {plan_cache.KEPT_HOW})", ")")
    plant({BIG: STALE, SMALL: STALE}, key=old_key)
    fake = timer(IDLE)
    plan = plan_of_a_model()
    assert fake.calls == [BIG, SMALL] and all(c.source == "timed" for c in plan.values())


def test_off_names_what_an_idle_timing_contradicts():
    mkl_at_one = {1: {"mkl": 20 * US, "onednn": 25 * US}}
    assert linear_auto.routes_from(mkl_at_one) == [(None, "mkl")]
    assert linear_auto.off(mkl_at_one, {1: {"mkl": 21 * US, "onednn": 24 * US}}) is None
    assert linear_auto.off(mkl_at_one, {1: {"mkl": 24 * US, "onednn": 23 * US}}) is None  # within the noise
    assert linear_auto.off(mkl_at_one, {1: {"mkl": 30 * US, "onednn": 23 * US}}) == \
        "MKL kept at M=1, where oneDNN is now faster by more than 10%: 23 us against 30"
    onednn_slower = {1: MIXED[1], 64: {"mkl": 1880 * US, "onednn": 2200 * US}}
    assert linear_auto.off(MIXED, onednn_slower) is None  # MKL ahead, but not by MIXED_MARGIN
    onednn_slower[64]["onednn"] = 2400 * US
    assert linear_auto.off(MIXED, onednn_slower) == \
        "oneDNN kept at M=64, where MKL is now faster by more than 25%: 1880 us against 2400"
    assert "kept at M [1]" in linear_auto.off(mkl_at_one, IDLE)


def test_off_names_a_rival_the_routes_would_now_take():
    """Between the dense backends a clear win moves an M; oneDNN kept yields to a dense backend
    only by MIXED_MARGIN (a second copy of the weight); an M the check did not time is not held."""
    kept_mkl = {1: {"mkl": 300 * US, "onednn": 320 * US, "dot": 260 * US},
                64: {"mkl": 1000 * US, "onednn": 1200 * US, "dot": 1050 * US}}
    assert linear_auto.backend_at(linear_auto.routes_from(kept_mkl), 64) == "mkl"
    assert linear_auto.off(kept_mkl, {64: {"mkl": 1100 * US, "onednn": 1200 * US, "dot": 1050 * US}}) is None
    assert linear_auto.off(kept_mkl, {64: {"mkl": 1150 * US, "onednn": 1200 * US, "dot": 950 * US}}) == \
        "MKL kept at M=64, where dot is now faster by more than 10%: 950 us against 1150"
    kept_onednn = {64: {"mkl": 1200 * US, "onednn": 1000 * US}}
    assert linear_auto.off(kept_onednn, {64: {"mkl": 900 * US, "onednn": 1100 * US}}) is None
    assert linear_auto.off(kept_onednn, {64: {"mkl": 850 * US, "onednn": 1100 * US}}) == \
        "oneDNN kept at M=64, where MKL is now faster by more than 25%: 850 us against 1100"


def test_a_machine_slower_or_faster_as_a_whole_keeps_its_plan():
    """A shared host's speed moves by a third from hour to hour, every backend alike, and a
    backend no M is routed to varies most: the kept plan still holds, and is not timed again
    at each load; a backend slower where it serves, so that a rival wins, re-times it."""
    for scale in (0.6, 1.45):
        now = {m: {b: s * scale for b, s in t.items()} for m, t in MIXED.items()}
        assert linear_auto.off(MIXED, now) is None
    mkl_slower_where_unused = {1: MIXED[1], 64: {"mkl": 1880 * 1.7 * US, "onednn": 1100 * US}}
    assert linear_auto.off(MIXED, mkl_slower_where_unused) is None
    slower_mkl = {1: {"mkl": 20 * 2.5 * US, "onednn": 45 * US}, 64: MIXED[64]}
    assert linear_auto.off(MIXED, slower_mkl).startswith("MKL kept at M=1, where oneDNN is now faster")


def test_mkl_serves_only_where_it_wins_clearly():
    assert linear_auto.routes_from({1: {"mkl": 1.0, "onednn": 1.09}}) == [(None, "onednn")]
    assert linear_auto.routes_from({1: {"mkl": 1.0, "onednn": 1.11}}) == [(None, "mkl")]
    assert linear_auto.routes_from(IDLE) == [(None, "onednn")]  # MKL 12% ahead at one row: one copy


def test_describe_says_where_the_plan_came_from():
    c = linear_backend.ShapeChoice(48, 16, 1, [(None, "onednn")], IDLE, "cache", "checked idle at 48x16")
    assert c.describe().endswith("[cache: checked idle at 48x16]")
    assert c.as_dict()["source"] == "cache"
    assert "[" not in linear_backend.ShapeChoice(48, 16, 1, [(None, "mkl")]).describe()


# the default model's gate/up on an AMD EPYC 26/2 (us): the panels well ahead at a decode
# batch, a few percent behind oneDNN at one row and at 512 rows
PANEL_AHEAD = {1: {"mkl": 350 * US, "onednn": 160 * US, "dot": 130 * US, "panel": 165 * US},
               64: {"mkl": 1200 * US, "onednn": 560 * US, "dot": 600 * US, "panel": 460 * US},
               512: {"mkl": 8500 * US, "onednn": 3600 * US, "dot": 4500 * US, "panel": 3700 * US}}


def test_one_packed_copy_the_faster_over_every_m():
    assert linear_auto.packed_of(PANEL_AHEAD) == "panel"
    assert linear_auto.routes_from(PANEL_AHEAD) == [(8, "dot"), (None, "panel")]
    behind = {m: {**t, "panel": t["panel"] * 1.3} for m, t in PANEL_AHEAD.items()}
    assert linear_auto.packed_of(behind) == "onednn"
    assert linear_auto.routes_from(behind) == [(None, "onednn")]  # "dot" 23% ahead at one row: one copy
    level = {m: {**t, "panel": t["onednn"]} for m, t in PANEL_AHEAD.items()}
    assert linear_auto.packed_of(level) == "onednn"  # a tie: oneDNN
    shared = linear_auto.routes_from(PANEL_AHEAD, shared=True)  # a tied head: the panels where they win by 10%
    assert shared == [(8, "dot"), (None, "panel")]


def test_a_kept_packed_backend_yields_only_to_one_faster_over_every_m_by_the_margin():
    kept_onednn = {m: {**t, "panel": t["onednn"] * 1.05} for m, t in PANEL_AHEAD.items()}
    assert linear_auto.routes_from(kept_onednn)[-1] == (None, "onednn")
    one_m_faster = {64: {**kept_onednn[64], "panel": kept_onednn[64]["onednn"] * 0.85}}
    assert linear_auto.off(kept_onednn, {1: kept_onednn[1], 512: kept_onednn[512], **one_m_faster}) is None
    assert linear_auto.off(kept_onednn, one_m_faster) == (
        "oneDNN kept, where the panel kernel is now faster by more than 10% (geometric mean over M "
        "[64]: 0.85x its time)")
    assert linear_auto.off(PANEL_AHEAD, {64: {**PANEL_AHEAD[64], "onednn": 470 * US}}) is None


def test_a_layer_holds_the_one_packed_copy_its_plan_names():
    plan = linear_backend.ShapeChoice(24, 16, 0, linear_auto.routes_from(PANEL_AHEAD), PANEL_AHEAD)
    layer = Linear(torch.randn(24, 16))
    layer.route(plan.routes)
    assert set(layer.prepared) == {"panel"} and layer.weight is not None  # "dot" serves one row
