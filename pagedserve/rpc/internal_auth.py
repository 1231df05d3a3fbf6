"""A shared secret that every call between the services carries (docs/ARCHITECTURE.md, "Who
may call whom"): without TLS, it is what keeps memsvc and the executor closed to other
processes on the host or the network.

Contract:
- `--internal-token` (env PAGEDSERVE_INTERNAL_TOKEN; a secret, so it travels by environment,
  never in a command line): given to memsvc and the executor, every call must carry it as
  metadata `x-pagedserve-internal-token` (compared in constant time, `TokenCheck`); a call
  without it, or with another, ends UNAUTHENTICATED before it reaches the service. Only
  grpc.health.v1 stays open (probes carry no secrets); reflection needs the token too. The
  step channel checks it once per connection, in its first frame (pagedserve.rpc.step_channel).
- Clients (the gateway, the executor registering, tools) give it to `open_channel`
  (pagedserve.rpc.grpc_service), which adds it to every call on the channel (`with_token`).
- `pagedserve serve` makes a fresh one per launch (`new_token`) and hands it to its
  children through their environment. Deployments give every service the same one.
- memsvc and the executor are closed by default: one started with neither a token nor
  mutual TLS (`--tls-cert`, `--tls-key`, `--tls-ca`, whose peer roles pagedserve.rpc.peer_auth
  checks) refuses to start (`require_closed`), unless `--insecure-internal` says it may take
  calls from anyone who reaches its port.
- A token is at least MIN_TOKEN_CHARS printable ASCII characters without spaces (it is gRPC
  metadata); `check_token` says so naming the setting.
"""
from __future__ import annotations

import collections
import hmac
import secrets

import grpc

from pagedserve.wire.settings import setting

METADATA_KEY = "x-pagedserve-internal-token"
ENV = "PAGEDSERVE_INTERNAL_TOKEN"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_TOKEN_CHARS = 16
REFUSED = (f"missing or wrong internal token: calls to memsvc and the executor carry the token "
           f"they were given (--internal-token, env {ENV}) as metadata {METADATA_KEY}")


def internal_token_setting():
    """The `--internal-token` field of memsvc's, the executor's and the gateway's configs."""
    return setting(None, "shared secret every call between the services carries; memsvc and the "
                   "executor refuse calls without it (UNAUTHENTICATED). Give every service the "
                   "same one; pagedserve serve makes a fresh one per launch", metavar="TOKEN",
                   secret=True)


def insecure_internal_setting():
    """The `--insecure-internal` field of memsvc's and the executor's configs."""
    return setting(False, "accept calls without --internal-token and without mutual TLS: any "
                   "process that reaches the port may read and overwrite the KV cache. Off: a "
                   "service with neither refuses to start (pagedserve serve makes a token)")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def check_token(token: str | None) -> None:
    """ValueError naming the setting when `token` (None or "": unset) cannot be one."""
    if not token:
        return
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("--internal-token must be printable ASCII without spaces (it travels as "
                         "gRPC metadata)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"--internal-token has {len(token)} characters: use at least "
                         f"{MIN_TOKEN_CHARS} random ones, e.g. python3 -c 'import secrets; "
                         f"print(secrets.token_urlsafe(32))'")


def matches(expected: str, presented: str | bytes | None) -> bool:
    """Constant-time comparison of a presented token with the expected one."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode()
    return hmac.compare_digest(presented, expected.encode())


def require_closed(service: str, token: str | None, tls, insecure: bool, log=None) -> None:
    """ValueError when `service` would take calls from anyone: no token, no mutual TLS
    (`tls`, a pagedserve.rpc.tls.TlsConfig) and not `insecure`; with `insecure`, a warning in `log`."""
    if token or (tls.cert and tls.ca):
        return
    if insecure:
        if log is not None:
            log.warning("--insecure-internal: no token and no mutual TLS, so any process that "
                        "reaches this port may call every method")
        return
    raise ValueError(f"{service} would accept calls from anyone who reaches its port: give it "
                     f"--internal-token (env {ENV}; the same on every service; pagedserve serve "
                     f"makes one itself), or mutual TLS (--tls-cert, --tls-key, --tls-ca), or "
                     f"--insecure-internal to accept that")


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refuse_stream(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
    yield  # pragma: no cover (makes this a generator)


class TokenCheck(grpc.ServerInterceptor):
    """Refuse every call but health's that lacks the token, before the service (and before
    its request is parsed)."""

    def __init__(self, token: str):
        check_token(token)
        if not token:
            raise ValueError("TokenCheck needs a token")
        self.token = token

    def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_PREFIXES) or self.presented(details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_refuse_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream)
        return grpc.unary_unary_rpc_method_handler(_refuse)

    def presented(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY:
                return matches(self.token, value)
        return False


def interceptors(token: str | None) -> list[grpc.ServerInterceptor]:
    """[TokenCheck(token)] when a token is set; [] otherwise."""
    return [TokenCheck(token)] if token else []


class _Details(collections.namedtuple("_Details", "method timeout metadata credentials "
                                                  "wait_for_ready compression"),
               grpc.ClientCallDetails):
    pass


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ((METADATA_KEY, token),)

    def _details(self, d):
        metadata = (*d.metadata, *self.metadata) if d.metadata else self.metadata
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` with the token in every call's metadata (itself when `token` is unset)."""
    return grpc.intercept_channel(channel, _AddToken(token)) if token else channel
