"""free_port: outside the kernel's ephemeral range, free, never handed out twice, never a reserved one."""
import socket

from pagedserve.rpc import ports
from pagedserve.rpc.ports import ephemeral_range, free_port


def test_ports_are_outside_the_ephemeral_range_and_distinct():
    low, high = ephemeral_range()
    given = [free_port() for _ in range(50)]
    assert len(set(given)) == 50
    assert all(not (low <= p <= high) for p in given), given
    for p in given[:5]:  # free: a listener can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_given(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports._random, "randint", lambda a, b: taken)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 2000, 65535))
        port = free_port()  # every draw hits the held port: the kernel's choice instead
    assert port != taken


def test_the_range_falls_back_to_linuxs_default(tmp_path):
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    (tmp_path / "range").write_text("20000\t40000\n")
    assert ephemeral_range(str(tmp_path / "range")) == (20000, 40000)


def test_a_reserved_port_is_not_given_though_it_is_free(monkeypatch):
    named = free_port()
    draws = iter([named, named, *range(named + 1, named + 500)])
    monkeypatch.setattr(ports, "_given", set())
    monkeypatch.setattr(ports._random, "randint", lambda a, b: next(draws))
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (named + 2000, 65535))
    ports.reserve(named, 0)
    assert free_port() not in (named, 0)
    assert 0 not in ports._given
