"""Optional TLS, and mutual TLS between the services, from three flags per process.

- `--tls-cert FILE` and `--tls-key FILE` (PEM): this process's certificate. A server with
  them listens with TLS; a client presents them when the server asks (mutual TLS).
- `--tls-ca FILE` (PEM): the CA that signed the peers. Clients verify servers with it
  (turning TLS on for their calls); memsvc and the executor, given it, also require and
  verify a client certificate signed by it (mutual TLS). The gateway's public port never
  asks clients for a certificate: the public API authenticates with --api-key.
- `--tls-server-name NAME`: the name clients expect in the servers' certificates when it
  differs from the host they dial.
- `--peer-roles` (on by default): with mutual TLS, memsvc and the executor also check the
  caller's role in its certificate (pagedserve.rpc.peer_auth: a URI SAN `spiffe://pagedserve/<role>`)
  per method; `--no-peer-roles` admits any certificate the CA signed.
Give all three services the same CA, and each its own certificate, to run them with
mutual TLS. Without flags everything is plaintext (the services listen on loopback).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from pagedserve.wire.settings import setting


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


@dataclass
class TlsConfig:
    cert: str | None = setting(None, "this service's TLS certificate, PEM (off: plaintext)",
                               name="tls_cert", metavar="FILE")
    key: str | None = setting(None, "its private key, PEM", name="tls_key", metavar="FILE")
    ca: str | None = setting(None, "CA certificate(s) that sign the other services, PEM: verify "
                             "servers and, on memsvc and the executor, require client "
                             "certificates (mutual TLS)", name="tls_ca", metavar="FILE")
    server_name: str | None = setting(None, "name expected in the servers' certificates, when not "
                                      "the host dialled", name="tls_server_name", metavar="NAME")
    peer_roles: bool = setting(True, "with mutual TLS, memsvc and the executor accept each method "
                               "only from callers whose certificate names the right role "
                               "(URI SAN spiffe://pagedserve/ROLE: gateway, executor)",
                               name="peer_roles")

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")

    @property
    def client_enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
        """TLS for a listener (None without a certificate); mutual when a CA is given and
        `require_client_cert`."""
        if not self.cert:
            return None
        mutual = require_client_cert and bool(self.ca)
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=_read(self.ca) if mutual else None,
            require_client_auth=mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.client_enabled:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca), private_key=_read(self.key),
                                            certificate_chain=_read(self.cert))

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
