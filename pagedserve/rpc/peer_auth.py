"""Role-based authorization of the internal services' callers, from their client certificates.

With mutual TLS (pagedserve.rpc.tls: `--tls-cert`, `--tls-key` and `--tls-ca` on memsvc and the
executor) every caller has a certificate signed by the CA; that says who may connect, not
what they may call. `PeerRoles` is the grpc server interceptor that says the second:

- A peer's role is read from its certificate: the path of a URI subject alternative name
  `spiffe://pagedserve/<role>` (cert-manager: `uris:`; several such URIs, several roles),
  or, when the certificate has none, its subject common name when that is a role name.
  Roles: gateway, executor, memsvc.
- Each service lists which roles may call which of its methods (memsvc: RegisterExecutor
  only from an executor, Reserve/Free/Fork/Tables/Stats/WatchBlocks only from gateways; the
  executor: Execute and ModelInfo only from gateways). Any other caller is refused with
  PERMISSION_DENIED, one without a certificate (plaintext, or TLS without a client
  certificate) with UNAUTHENTICATED. Health and reflection are open to any peer the
  listener admitted.
- It is on whenever the listener requires client certificates (`--tls-ca` with a
  certificate), unless `--no-peer-roles` turns it off (a CA whose certificates carry no role).
"""
from __future__ import annotations

import grpc

ROLES = ("gateway", "executor", "memsvc")
SPIFFE_PREFIX = "spiffe://pagedserve/"

# Who may call what: method path -> roles. Methods of a service listed here but not named
# are refused; services not listed here (health, reflection) are open.
MEMSVC_POLICY = {
    "/pagedserve.v1.MemoryManager/RegisterExecutor": {"executor"},
    "/pagedserve.v1.MemoryManager/Reserve": {"gateway"},
    "/pagedserve.v1.MemoryManager/Free": {"gateway"},
    "/pagedserve.v1.MemoryManager/Fork": {"gateway"},
    "/pagedserve.v1.MemoryManager/Tables": {"gateway"},
    "/pagedserve.v1.MemoryManager/Stats": {"gateway"},
    "/pagedserve.v1.MemoryManager/WatchBlocks": {"gateway"},
}
EXECUTOR_POLICY = {
    "/pagedserve.v1.Executor/Execute": {"gateway"},
    "/pagedserve.v1.Executor/ModelInfo": {"gateway"},
}


def _text(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values or []]


def peer_roles(auth_context: dict) -> set[str]:
    """The roles in a peer's certificate (see module doc; one certificate may name several,
    e.g. for `pagedserve serve`, whose children share one); empty without any."""
    if _text(auth_context.get("transport_security_type"))[:1] != ["ssl"]:
        return set()
    uris = [n for n in _text(auth_context.get("x509_subject_alternative_name"))
            if n.startswith(SPIFFE_PREFIX)]
    if uris:
        return {n[len(SPIFFE_PREFIX):].strip("/") for n in uris} & set(ROLES)
    common = _text(auth_context.get("x509_common_name"))
    return {common[0]} if common and common[0] in ROLES else set()


def has_certificate(auth_context: dict) -> bool:
    return bool(auth_context.get("x509_pem_cert") or auth_context.get("x509_common_name")
                or auth_context.get("x509_subject_alternative_name"))


class PeerRoles(grpc.ServerInterceptor):
    """Refuse calls whose peer's certificate lacks the role `policy` names for the method."""

    def __init__(self, policy: dict[str, set[str]]):
        self.policy = dict(policy)
        self.services = {m.rsplit("/", 1)[0] for m in self.policy}

    def allowed(self, method: str) -> set[str] | None:
        """The roles that may call `method`; None: open (a service this policy does not cover)."""
        if method.rsplit("/", 1)[0] not in self.services:
            return None
        return self.policy.get(method, set())

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        roles = self.allowed(details.method)
        if handler is None or roles is None:
            return handler

        def check(context) -> None:
            auth = context.auth_context()
            have = peer_roles(auth)
            if have & roles:
                return
            if not has_certificate(auth):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              f"{details.method} needs a client certificate (mutual TLS)")
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{details.method} is for {', '.join(sorted(roles))} only; the caller's "
                          f"certificate says {', '.join(sorted(have)) or 'no role'}")

        return _guarded(handler, check)


def _guarded(handler, check):
    """`handler` with `check(context)` run before its behaviour (all four call shapes)."""
    for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                       ("unary_stream", grpc.unary_stream_rpc_method_handler),
                       ("stream_unary", grpc.stream_unary_rpc_method_handler),
                       ("stream_stream", grpc.stream_stream_rpc_method_handler)):
        inner = getattr(handler, kind)
        if inner is None:
            continue
        if kind.endswith("_stream"):
            def behaviour(request, context, inner=inner):
                check(context)
                yield from inner(request, context)
        else:
            def behaviour(request, context, inner=inner):
                check(context)
                return inner(request, context)
        return make(behaviour, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    return handler


def interceptors(tls, policy: dict[str, set[str]]) -> list[grpc.ServerInterceptor]:
    """[PeerRoles(policy)] when `tls` (pagedserve.rpc.tls.TlsConfig) makes the listener mutual TLS and
    peer roles are on; [] otherwise."""
    if tls is not None and tls.cert and tls.ca and tls.peer_roles:
        return [PeerRoles(policy)]
    return []
