"""Ports for services that another process starts: `free_port()` answers a port that nothing
listens on, for the caller to hand to a service that binds it later.

A port the kernel picks with bind(0) comes from the ephemeral range, which is also where every
outgoing connection takes its local port: in the seconds before the service binds, any client
in the machine can take it. So the ports are drawn outside that range (read from
/proc/sys/net/ipv4/ip_local_port_range), and one process never hands out the same port twice,
nor one it was told is spoken for (`reserve`: ports the user named, not bound yet).
"""
from __future__ import annotations

import random
import socket
import threading

_LOWEST = 10000  # below this, ports that well-known servers claim
_given: set[int] = set()
_lock = threading.Lock()
_random = random.SystemRandom()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def reserve(*ports: int) -> None:
    """Never hand out these ports (0, "any port", is ignored): a port named for a service that
    binds it later is free now, and a drawn port that met it would keep that service from binding."""
    with _lock:
        _given.update(p for p in ports if p)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on, outside the ephemeral range, not given before."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST, low - 1), (high + 1, 65535)) if b - a > 1000]
    with _lock:
        for _ in range(200):
            if not spans:
                break
            a, b = _random.choice(spans)
            port = _random.randint(a, b)
            if port not in _given and _binds(host, port):
                _given.add(port)
                return port
        while True:  # no span outside the ephemeral range is free: the kernel's choice
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
