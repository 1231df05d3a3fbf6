"""pagedserve.gateway.router without processes: prefix-aware routing and round-robin."""
from types import SimpleNamespace

from pagedserve.gateway.router import Router
from pagedserve.wire.block_keys import cacheable_blocks, prompt_block_keys


class FakeIndex:
    def __init__(self, keys=(), usage=0.0):
        self.keys, self.usage = set(keys), usage

    def leading(self, keys):
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def note_routed(self, keys):
        self.keys.update(keys)

    def kv_usage(self):
        return self.usage


def replica(name, keys=(), queued=0, usage=0.0):
    return SimpleNamespace(name=name, index=FakeIndex(keys, usage), queued=lambda: queued)


def test_prefix_routing_follows_the_cached_prefix_unless_the_holder_is_loaded():
    prompt = list(range(100))
    keys = prompt_block_keys(prompt, 16, max_blocks=cacheable_blocks(100, 16))
    assert len(keys) == 6
    router = Router("prefix", block_size=16, max_num_seqs=8, registry=None)
    holder, other = replica("a", keys), replica("b")
    for _ in range(3):
        assert router.choose([other, holder], prompt).replica is holder
    route = router.choose([other, holder], prompt)
    assert route.reason == "prefix" and route.cached_blocks == 6
    assert route.attributes()["pagedserve.route.replica"] == "a"
    busy = replica("a", keys, queued=16, usage=0.9)  # score 0.96 - 0.5 * (0.9 + 2) < 0
    assert router.choose([other, busy], prompt).replica is other


def test_prefix_routing_sends_a_new_prefix_to_the_least_loaded_then_keeps_it_there():
    router = Router("prefix", block_size=16, max_num_seqs=8, registry=None)
    a, b = replica("a", queued=4), replica("b", queued=0)
    first = router.choose([a, b], list(range(40)))
    assert first.replica is b and first.reason == "load"
    assert router.choose([a, b], list(range(40)) + [7]).replica is b  # noted before memsvc says


def test_round_robin_takes_turns():
    router = Router("round-robin", block_size=16, registry=None)
    a, b = replica("a"), replica("b")
    names = [router.choose([a, b], [1, 2, 3]).replica.name for _ in range(4)]
    assert names == ["a", "b", "a", "b"]
