"""KVGeometry's sliding window crosses the wire (executor -> memsvc RegisterExecutor)."""
import pytest

from pagedserve.wire import convert
from pagedserve.wire.protocol import KVGeometry


@pytest.mark.parametrize("window", [0, 4096])
def test_window_round_trips(window):
    g = KVGeometry(2, 2, 8, 16, "bfloat16", window=window)
    assert convert.geometry_from_proto(convert.geometry_to_proto(g)) == g


def test_negative_window_refused():
    with pytest.raises(ValueError, match="window"):
        KVGeometry(1, 1, 1, 4, window=-1)
