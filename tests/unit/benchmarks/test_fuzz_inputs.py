"""`bench fuzz`'s request generators, without a server: a (seed, index) gives one probe, every
category is drawn, requests the server could accept stay small work, and gRPC probes with
invalid UTF-8 are ones the protobuf library itself would refuse to parse."""
import json

import pytest
from google.protobuf.message import DecodeError

from pagedserve.benchmarks.fuzz_http import Target
from pagedserve.benchmarks.fuzz_inputs import WEIGHTS, make_probe
from pagedserve.benchmarks.fuzz_prefixes import Prefixes
from pagedserve.wire.v1 import generation_pb2 as pb

TARGET = Target("m", 8192)
PREFIXES = Prefixes(7)
PROBES = [make_probe(7, i, TARGET, PREFIXES) for i in range(600)]


def test_a_seed_and_index_give_one_probe():
    assert make_probe(7, 3, TARGET, PREFIXES) == PROBES[3]
    assert [p.body for p in PROBES[:20]] != [make_probe(8, i, TARGET, Prefixes(8)).body for i in range(20)]


def test_every_category_and_both_apis_are_drawn():
    assert {p.category for p in PROBES} == set(WEIGHTS)
    assert {p.api for p in PROBES} == {"http", "grpc"}
    assert any(p.fresh_prefix for p in PROBES) and any(p.leaves for p in PROBES)


def test_categories_limit_the_draw():
    assert {make_probe(1, i, TARGET, PREFIXES, ("tools",)).category for i in range(20)} == {"tools"}


def test_fresh_prefixes_are_used_once_and_shared_ones_often():
    fresh = [p.prefix for p in PROBES if p.fresh_prefix]
    assert len(fresh) == len(set(fresh)) > 50
    shared = [p.prefix for p in PROBES if not p.fresh_prefix]
    assert len(set(shared)) == PREFIXES.count
    assert not set(fresh) & set(shared)


def _json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_accepted_request_is_small_work(field):
    """max_tokens is either small or one the server must refuse (no long generation)."""
    for p in PROBES:
        body = _json(p.body) if p.api == "http" else None
        if not isinstance(body, dict):
            continue
        value = body.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= TARGET.max_model_len:
            assert value <= 48, (p.index, p.category, value)
        if "messages" in body and p.target == "/v1/chat/completions":
            assert "max_tokens" in body or "max_completion_tokens" in body, p.index  # chat's default: all


def test_grpc_probes_parse_or_hold_invalid_utf8():
    grpc = [p for p in PROBES if p.api == "grpc"]
    kinds = {"Generate": pb.GenerateRequest, "Chat": pb.ChatRequest, "Tokenize": pb.TokenizeRequest}
    refused = 0
    for p in grpc:
        try:
            kinds[p.target.rsplit("/", 1)[1]].FromString(p.body)
        except DecodeError:
            refused += 1
    assert 0 < refused < len(grpc) / 2


def test_describe_truncates_and_escapes():
    huge = max(PROBES, key=lambda p: len(p.body))
    assert len(huge.body) > 1 << 20 and len(huge.describe(400)) < 600
    assert all("\ud800" not in p.describe() for p in PROBES)  # lone surrogates shown escaped


def test_every_probe_of_a_long_run_can_be_made():
    """A generator that raises would end a long run (seed 1 of `bench fuzz` once did, at an
    index past the CI run's: a wrong-typed `messages` replaced earlier in the same probe)."""
    for seed in (1, 2):
        prefixes = Prefixes(seed)
        for i in range(1500):
            make_probe(seed, i, TARGET, prefixes)
