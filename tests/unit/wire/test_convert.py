"""Every protocol dataclass survives a trip through its protobuf twin and the wire: hand-picked
cases, and one per message generated from its dataclass with every field off its default,
so a field added to a dataclass and not to pagedserve/wire/convert.py fails here."""
import dataclasses
import types
import typing

import pytest

from pagedserve.memsvc.memory_manager import MemoryConfig, MemoryManager
from pagedserve.wire import convert, step_convert
from pagedserve.wire.protocol import (
    KVGeometry,
    ModelInfo,
    PoolStats,
    PromptLogprob,
    SampleOutput,
    SamplingParams,
)
from pagedserve.wire.reserve_messages import (
    Fills,
    Grant,
    Grants,
    Plan,
    PlanEntry,
    Preemption,
    Rejection,
    ReserveResult,
)
from pagedserve.wire.pending_token import PENDING
from pagedserve.wire.v1 import executor_pb2, generation_pb2, memory_pb2
from tests.support.written import Steps


def wire(msg):
    return type(msg).FromString(msg.SerializeToString())


SAMPLINGS = [
    SamplingParams(),
    SamplingParams(max_tokens=7, temperature=0.0, seed=0, logprobs=0, n=3, ignore_eos=True),
    SamplingParams(temperature=0.5, top_p=0.25, top_k=40, min_p=0.125, repetition_penalty=1.5,
                   presence_penalty=-0.5, frequency_penalty=2.0, seed=2**63 - 1,
                   stop=["\n\n", "é"], stop_token_ids=[1, 2], logprobs=5),
    SamplingParams(prompt_logprobs=0),
    SamplingParams(prompt_logprobs=20, logprobs=1),
    SamplingParams(n=2, beam_width=4, length_penalty=0.7, early_stopping=True, max_tokens=30),
    SamplingParams(beam_width=2, length_penalty=0.0),
    SamplingParams(guided_kind="json_schema", guided_spec='{"type": "object", "required": ["é"]}'),
    SamplingParams(guided_kind="regex", guided_spec=r"\d{3}-[a-z]+", temperature=0.0),
    SamplingParams(guided_kind="choice", guided_spec='["yes", "no"]', n=3),
    SamplingParams(guided_kind="grammar", guided_spec='root ::= "a" | "b"'),
    SamplingParams(guided_kind="json_object"),
    SamplingParams(min_tokens=5, stop_token_ids=[7], max_tokens=9),
    SamplingParams(logit_bias={0: -100.0, 50256: 0.7, 2**32 - 1: 100.0}),
]


@pytest.mark.parametrize("sp", SAMPLINGS)
def test_sampling_params(sp):
    assert convert.sampling_from_proto(wire(convert.sampling_to_proto(sp))) == sp


def test_sampling_defaults_of_an_empty_message():
    assert convert.sampling_from_proto(generation_pb2.SamplingParams()) == SamplingParams()


def test_model_info_with_tokenizer_files():
    info = ModelInfo("m", 2048, 49152, [0, 2], "{{ x }}", "/tmp/x", KVGeometry(30, 3, 64, 16, "bfloat16"))
    files = {"tokenizer.json": b"{}", "tokenizer_config.json": b'{"a": 1}'}
    msg = wire(convert.model_info_to_proto(info, files))
    assert {f.name: f.content for f in msg.tokenizer_files} == files
    assert convert.model_info_from_proto(msg, "/tmp/x") == info
    info.chat_template = None
    assert convert.model_info_from_proto(wire(convert.model_info_to_proto(info)), "/tmp/x") == info


def test_plan():
    plan = Plan([
        PlanEntry("a/0", [1, 2, 3], True, 100, max_new_tokens=2, final_len=0, salt=""),
        PlanEntry("b/0", [9], False, 50, final_len=42, salt="s"),
        PlanEntry("c/0", [], False, 10),
        PlanEntry("d/0", [4, 5], True, 10, skip_prefix_cache=True),
    ], free=["x/0", "y/1"], forks=[("b/0", "b/1"), ("b/0", "b/2")])
    msg = wire(step_convert.plan_to_proto(plan, "session-1"))
    assert msg.session_id == "session-1"
    assert step_convert.plan_from_proto(msg) == plan


def test_a_plans_running_sequences_travel_in_columns():
    """Running sequences carry only id and tokens, PENDING among them, across the wire
    (memsvc reads max_len, final_len and salt of new sequences only)."""
    plan = Plan([
        PlanEntry("r/0", [1], False, 0), PlanEntry("r/1", [PENDING], False, 0),
        PlanEntry("r/2", [3, 4, 5], False, 0), PlanEntry("n/0", [6, 7], True, 30, max_new_tokens=2),
        PlanEntry("late/0", [8], False, 20),  # (not produced by the gateway: it goes with the running)
    ], ahead=True, fills=[("r/0", 4, 11)])
    msg = wire(step_convert.plan_to_proto(plan))
    assert msg.joined_run_seq_ids == "r/0\nr/1\nr/2\nlate/0" and not msg.run_seq_ids
    assert list(msg.run_token_ids) == [1, PENDING, 3, 4, 5, 8] and list(msg.run_num_tokens) == [1, 1, 3, 1]
    assert msg.joined_new_seq_ids == "n/0" and not msg.entries  # (new_columns)
    assert step_convert.plan_from_proto(msg) == plan
    msg.run_num_tokens[0] = 2
    with pytest.raises(ValueError, match="do not agree"):
        step_convert.plan_from_proto(msg)


def test_a_steady_plan_sends_its_ids_once_and_its_constant_columns_as_flags():
    """Fills whose ids are the running ids, in order, send them once (fills_run_ids); one
    PENDING token for each running sequence travels as run_one_pending_each."""
    plan = Plan(ahead=True, run_ids=["r/0", "r/1"], run_counts=[1, 1], run_tokens=[PENDING, PENDING],
                fills=[("r/0", 4, 11), ("r/1", 7, 12)])
    msg = wire(step_convert.plan_to_proto(plan))
    assert msg.fills_run_ids and not msg.fill_seq_ids and not msg.joined_fill_seq_ids
    assert msg.run_one_pending_each and not msg.run_num_tokens and not msg.run_token_ids
    assert step_convert.plan_from_proto(msg) == plan
    msg.run_token_ids.append(PENDING)
    with pytest.raises(ValueError, match="run_token_ids must be empty"):
        step_convert.plan_from_proto(msg)
    plan.run_tokens = [PENDING, 5]
    msg = wire(step_convert.plan_to_proto(plan))
    assert not msg.run_one_pending_each and list(msg.run_token_ids) == [PENDING, 5]
    assert step_convert.plan_from_proto(msg) == plan
    plan.fills = Fills(["r/1", "r/0"], [7, 4], [12, 11])  # another order: its own ids
    msg = wire(step_convert.plan_to_proto(plan))
    assert not msg.fills_run_ids and msg.joined_fill_seq_ids == "r/1\nr/0"
    assert step_convert.plan_from_proto(msg) == plan
    msg.fills_run_ids = True
    with pytest.raises(ValueError, match="fills_run_ids"):
        step_convert.plan_from_proto(msg)
    msg.joined_fill_seq_ids = ""
    del msg.fill_positions[-1]
    with pytest.raises(ValueError, match="same length"):
        step_convert.plan_from_proto(msg)


def test_reserve_result():
    r = ReserveResult(
        grants=Grants(["a/0", "b/0", "c/1"], [16, 0, 5], [3, 1, 1], [1, 0, 0], [1, 1, 0], [7, 0], [16, 0, 0]),
        preempted=[Preemption("c/0", "recompute"), Preemption("d/0", "swap")],
        rejected=[Rejection("e/0", "too long")], waiting=["f/0", "g/0"], resumed=["h/0"],
        pool_epoch="0123abcd",
    )
    assert step_convert.reserve_result_from_proto(wire(step_convert.reserve_result_to_proto(r))) == r
    assert step_convert.reserve_result_from_proto(memory_pb2.ReserveResponse()) == ReserveResult()


def test_sample_outputs():
    outs = [SampleOutput("a/0", 5), SampleOutput("b/0", 0, -0.5, [(0, -0.5), (3, -1.25)])]
    assert step_convert.outputs_from_proto(wire(step_convert.outputs_to_proto(outs))) == outs
    assert step_convert.outputs_from_proto(executor_pb2.ExecuteResponse()) == []
    plain = [SampleOutput("a/0", 5), SampleOutput("b/0", 0)]
    msg = wire(step_convert.outputs_to_proto(plain, "inc"))
    assert list(msg.tokens) == [5, 0] and not msg.outputs and msg.incarnation == "inc"
    assert step_convert.outputs_from_proto(msg, ["a/0", "b/0"]) == plain


def test_sample_outputs_with_prompt_logprobs():
    entries = [PromptLogprob(7, -1.5, 3, [(2, -0.25), (9, -1.0)]), PromptLogprob(8, -0.125, 1)]
    outs = [SampleOutput("a/0", -1, sampled=False, prompt_logprobs=entries),
            SampleOutput("b/0", 4, prompt_logprobs=entries[1:]), SampleOutput("c/0", 5)]
    msg = wire(step_convert.outputs_to_proto(outs))
    assert not msg.tokens and [o.prompt_only for o in msg.outputs] == [True, False, False]
    assert step_convert.outputs_from_proto(msg, ["b/0", "c/0"]) == outs


def test_stats_from_a_memory_manager():
    mem = MemoryManager(MemoryConfig(num_blocks=8))
    mem.register_executor(KVGeometry(1, 1, 1, 4))
    mem.reserve(Plan([PlanEntry("a/0", [1, 2, 3, 4, 5], True, 10)]))
    stats = mem.stats()
    back = convert.stats_from_proto(wire(convert.stats_to_proto(stats, 4, num_sequences=1, num_sessions=2)))
    for key in ("num_blocks", "blocks_free", "blocks_cached", "blocks_referenced", "token_state",
                "reserved", "free", "total_slots", "token_state_fraction"):
        assert back.snapshot[key] == pytest.approx(stats.snapshot[key]), key
    assert back.snapshot["blocks_referenced"] == 2
    assert (back.num_sequences, back.num_sessions) == (1, 2)
    assert back.num_preemptions == stats.num_preemptions
    assert type(stats) is type(back) is PoolStats
    assert back.preemption == stats.preemption
    own = convert.stats_from_proto(wire(convert.stats_to_proto(stats, 4)))
    assert (own.num_sequences, own.num_sessions) == (stats.num_sequences, stats.num_sessions) == (1, 0)


def test_stats_carry_the_host_tier():
    mem = MemoryManager(MemoryConfig(num_blocks=4, num_offload_blocks=8, offload_policy="always"))
    mem.register_executor(KVGeometry(1, 1, 1, 4))
    a, b = list(range(100, 113)), list(range(300, 313))
    steps = Steps(mem)  # each step runs before the next plan
    for seq_id, prompt in (("a", a), ("b", b), ("c", a)):  # b evicts a's blocks; c restores them
        steps.reserve(Plan([PlanEntry(seq_id, prompt, True, 16)]))
        steps.reserve(Plan([], free=[seq_id]))
    stats = mem.stats()
    p = stats.preemption
    assert p["host_tier_offloaded"] > 0 and p["host_tier_restored"] == 3 and p["host_tier_tokens_restored"] == 12
    assert 0 < p["host_tier_hit_rate"] <= 1
    back = convert.stats_from_proto(wire(convert.stats_to_proto(stats, 4)))
    assert back.preemption == pytest.approx(p)  # every counter travels, none is dropped


@pytest.mark.parametrize("kw, message", [
    (dict(prompt_logprobs=-1), "prompt_logprobs must be between 0 and 20, got -1"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be between 0 and 20, got 21"),
    (dict(prompt_logprobs=2, beam_width=2), "prompt_logprobs is not supported with beam search"),
])
def test_prompt_logprobs_validation(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw).validate()


# -- every field of every message, generated -------------------------------------------------

VALUES = {"guided_kind": "json_schema", "mode": "swap", "dtype": "bfloat16"}  # fields with a vocabulary
FIXED = {("SampleOutput", "token_id"): -1,  # sampled=False: a prompt-only output has no token
         ("PlanEntry", "new"): True,  # (a running one moves into the plan's columns)
         ("Plan", "run_counts"): [1, 1], ("Grants", "num_new_blocks"): [1, 1]}  # the columns agree


def off_default(hint, default, name):
    """A value of type `hint` that is not `default` (lists of two, dataclasses built whole)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if name in VALUES:
        return VALUES[name]
    if origin in (typing.Union, types.UnionType):
        return off_default(next(a for a in args if a is not type(None)), None, name)
    if dataclasses.is_dataclass(hint):
        return generated(hint)
    if origin is list:
        return [off_default(args[0], None, name), off_default(args[0], None, name)]
    if origin is dict:
        return {off_default(args[0], None, name): off_default(args[1], None, name)}
    if origin is tuple:
        return tuple(off_default(a, None, name) for a in args)
    if hint is bool:
        return not default if isinstance(default, bool) else True
    if hint is int:
        return (default or 0) + 3
    if hint is float:
        return (default or 0.0) + 0.375  # exact in float32
    if hint is str:
        return f"{name}-x"
    raise TypeError(f"no generated value for {name}: {hint}; add one to off_default")


# fields that are not on the wire: a reading of others there, or set where they are read
NOT_ON_THE_WIRE: set[tuple[str, str]] = {
    ("ModelInfo", "aliases"),  # the gateway's own --served-model-name (pagedserve.wire.served_names)
}


def generated(cls):
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if (cls.__name__, f.name) in NOT_ON_THE_WIRE:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        values[f.name] = FIXED.get((cls.__name__, f.name), off_default(hints[f.name], default, f.name))
    return cls(**values)


ROUND_TRIPS = {
    "SamplingParams": (SamplingParams, lambda x: convert.sampling_from_proto(wire(convert.sampling_to_proto(x)))),
    "KVGeometry": (KVGeometry, lambda x: convert.geometry_from_proto(wire(convert.geometry_to_proto(x)))),
    "ModelInfo": (ModelInfo, lambda x: convert.model_info_from_proto(wire(convert.model_info_to_proto(x)),
                                                                     x.tokenizer_dir)),
    "Plan": (Plan, lambda x: step_convert.plan_from_proto(wire(step_convert.plan_to_proto(x)))),
    "ReserveResult": (ReserveResult, lambda x: step_convert.reserve_result_from_proto(
        wire(step_convert.reserve_result_to_proto(x)))),
    "SampleOutput": (SampleOutput, lambda x: step_convert.outputs_from_proto(wire(step_convert.outputs_to_proto([x])))[0]),
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_every_field_of_a_message_round_trips(name):
    cls, trip = ROUND_TRIPS[name]
    msg = generated(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING and (name, f.name) not in NOT_ON_THE_WIRE:
            assert getattr(msg, f.name) != f.default, f"{name}.{f.name} was generated at its default"
    assert trip(msg) == msg


def test_new_sequences_travel_in_columns_unless_one_has_a_final_len_or_a_salt():
    entries = [PlanEntry("a/0", [1, 2, 3], True, 30, 8), PlanEntry("b/0", [4], True, 20, 0, skip_prefix_cache=True),
               PlanEntry("c/0", [], True, 5)]
    plan = Plan(list(entries))
    msg = wire(step_convert.plan_to_proto(plan))
    assert not msg.entries and msg.joined_new_seq_ids == "a/0\nb/0\nc/0"
    assert list(msg.new_num_tokens) == [3, 1, 0] and list(msg.new_token_ids) == [1, 2, 3, 4]
    assert step_convert.plan_from_proto(msg) == plan
    for odd in (PlanEntry("d/0", [5], True, 9, final_len=7), PlanEntry("d/0", [5], True, 9, salt=""),
                PlanEntry("d\n0", [5], True, 9)):
        plan = Plan(entries + [odd])
        msg = wire(step_convert.plan_to_proto(plan))
        assert len(msg.entries) == 4 and not msg.joined_new_seq_ids and not msg.new_token_ids
        assert step_convert.plan_from_proto(msg) == plan
    msg = wire(step_convert.plan_to_proto(Plan(list(entries))))
    msg.new_token_ids.append(9)
    with pytest.raises(ValueError, match="do not agree"):
        step_convert.plan_from_proto(msg)
    del msg.new_token_ids[-1]
    msg.entries.add(seq_id="e/0", token_ids=[1], max_len=4)
    with pytest.raises(ValueError, match="one way"):
        step_convert.plan_from_proto(msg)
    msg.joined_new_seq_ids = ""
    with pytest.raises(ValueError, match="without joined_new_seq_ids"):
        step_convert.plan_from_proto(msg)
    del msg.entries[:]  # new_* columns alone, no ids and no entries: refused too
    with pytest.raises(ValueError, match="without joined_new_seq_ids"):
        step_convert.plan_from_proto(msg)


def test_a_decode_steps_constant_grant_columns_travel_as_flags():
    g = Grants(["a", "b"], [9, 16], [1, 1], [1, 1], [0, 0], [], [0, 0])
    m = wire(step_convert.reserve_result_to_proto(ReserveResult(g)))
    assert m.grants_one_token_uncached and m.grants_no_new_blocks
    assert not (m.grant_num_tokens or m.grant_num_cached or m.grant_num_new_blocks)
    assert step_convert.reserve_result_from_proto(m).grants == g
    m.grant_new_blocks.append(4)  # no new block, said the flag
    with pytest.raises(ValueError, match="do not agree"):
        step_convert.reserve_result_from_proto(m)
    m.grant_num_cached.append(0)
    with pytest.raises(ValueError, match="grant_num_cached must be empty"):
        step_convert.reserve_result_from_proto(m)
    g.num_cached[1] = 3  # then both columns go as they are
    m = wire(step_convert.reserve_result_to_proto(ReserveResult(g)))
    assert not m.grants_one_token_uncached and list(m.grant_num_tokens) == [1, 1] and m.grants_no_new_blocks
    assert step_convert.reserve_result_from_proto(m).grants == g


def test_the_grant_columns_go_as_they_are_and_must_agree():
    g = Grants(["a", "b", "c"], [9, 16, 4], [1, 2, 1], [2, 1, 1], [0, 2, 1], [7, 8, 3], [0, 0, 0])
    m = wire(step_convert.reserve_result_to_proto(ReserveResult(g, pool_epoch="e")))
    back = step_convert.reserve_result_from_proto(m)
    assert back.grants == g and back.pool_epoch == "e"
    assert list(back.grants)[1] == Grant("b", 16, 2, 1, [7, 8], 0)
    m.grant_new_blocks.append(4)
    with pytest.raises(ValueError, match="do not agree"):
        step_convert.reserve_result_from_proto(m)