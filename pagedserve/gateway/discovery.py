"""Find executor replicas by DNS: a name that answers with one address per replica.

On Kubernetes the executor pods sit behind a headless Service (deploy/), whose name
resolves to every ready pod; each pod runs memsvc and the executor on known ports. The
gateway resolves the name again every few seconds (pagedserve.gateway.replica_set): a new address is
a replica that appeared and is used; one that is gone stops answering its probes and is
dropped from routing.
"""
from __future__ import annotations

import socket


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dns_replicas(name: str, memsvc_port: int, executor_port: int) -> list[tuple[str, str]]:
    """(memsvc, executor) addresses for every address `name` resolves to; [] when it does not."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    hosts = sorted({info[4][0] for info in infos})
    return [(host_port(h, memsvc_port), host_port(h, executor_port)) for h in hosts]


def parse_ports(value: str) -> tuple[int, int]:
    """'MEMSVC_PORT,EXECUTOR_PORT' -> (memsvc port, executor port)."""
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--discover-ports wants MEMSVC_PORT,EXECUTOR_PORT, got {value!r}")
    return int(parts[0]), int(parts[1])
