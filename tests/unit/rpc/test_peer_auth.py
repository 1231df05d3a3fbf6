"""pagedserve.rpc.peer_auth without sockets: roles read from a certificate's auth context, the policy per
method, the status of a refusal, and when the interceptor is on."""
from types import SimpleNamespace

import grpc
import pytest

from pagedserve.rpc import peer_auth
from pagedserve.rpc.tls import TlsConfig


def ctx(sans=(), cn=None, ssl=True):
    auth = {"transport_security_type": [b"ssl" if ssl else b"insecure"]}
    if sans:
        auth["x509_subject_alternative_name"] = [s.encode() for s in sans]
    if cn:
        auth["x509_common_name"] = [cn.encode()]
    return auth


def test_roles_come_from_spiffe_uris_else_a_role_named_common_name():
    assert peer_auth.peer_roles(ctx(["localhost", "spiffe://pagedserve/gateway"], cn="x")) == {"gateway"}
    assert peer_auth.peer_roles(ctx(["spiffe://pagedserve/gateway", "spiffe://pagedserve/executor"])) \
        == {"gateway", "executor"}
    assert peer_auth.peer_roles(ctx(["spiffe://pagedserve/admin"], cn="gateway")) == set()  # URI wins
    assert peer_auth.peer_roles(ctx(["spiffe://other/gateway"], cn="executor")) == {"executor"}
    assert peer_auth.peer_roles(ctx(cn="client")) == set()
    assert peer_auth.peer_roles(ctx(["spiffe://pagedserve/gateway"], ssl=False)) == set()


class Aborted(Exception):
    pass


def run(policy, method, auth):
    """Call `method` through PeerRoles(policy); the status it aborted with, or OK."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: "answer")
    guarded = peer_auth.PeerRoles(policy).intercept_service(
        lambda details: handler, SimpleNamespace(method=method, invocation_metadata=()))

    def abort(code, message):
        raise Aborted(code)
    context = SimpleNamespace(auth_context=lambda: auth, abort=abort)
    try:
        assert guarded.unary_unary(None, context) == "answer"
    except Aborted as e:
        return e.args[0]
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method,role,want", [
    ("/pagedserve.v1.MemoryManager/RegisterExecutor", "executor", grpc.StatusCode.OK),
    ("/pagedserve.v1.MemoryManager/RegisterExecutor", "gateway", grpc.StatusCode.PERMISSION_DENIED),
    ("/pagedserve.v1.MemoryManager/Reserve", "gateway", grpc.StatusCode.OK),
    ("/pagedserve.v1.MemoryManager/Reserve", "executor", grpc.StatusCode.PERMISSION_DENIED),
    ("/pagedserve.v1.MemoryManager/SomethingNew", "gateway", grpc.StatusCode.PERMISSION_DENIED),
    ("/grpc.health.v1.Health/Check", None, grpc.StatusCode.OK),
])
def test_memsvc_policy(method, role, want):
    auth = ctx([f"spiffe://pagedserve/{role}"]) if role else ctx(cn="anyone")
    assert run(peer_auth.MEMSVC_POLICY, method, auth) == want


def test_executor_policy_and_a_caller_without_a_certificate():
    execute = "/pagedserve.v1.Executor/Execute"
    assert run(peer_auth.EXECUTOR_POLICY, execute, ctx(["spiffe://pagedserve/gateway"])) == grpc.StatusCode.OK
    assert run(peer_auth.EXECUTOR_POLICY, execute, ctx(cn="memsvc")) == grpc.StatusCode.PERMISSION_DENIED
    assert run(peer_auth.EXECUTOR_POLICY, execute, ctx(ssl=False)) == grpc.StatusCode.UNAUTHENTICATED


def test_on_with_mutual_tls_unless_turned_off():
    mutual = dict(cert="c.pem", key="k.pem", ca="ca.pem")
    assert len(peer_auth.interceptors(TlsConfig(**mutual), peer_auth.MEMSVC_POLICY)) == 1
    assert peer_auth.interceptors(TlsConfig(**mutual, peer_roles=False), peer_auth.MEMSVC_POLICY) == []
    assert peer_auth.interceptors(TlsConfig(cert="c.pem", key="k.pem"), peer_auth.MEMSVC_POLICY) == []
    assert peer_auth.interceptors(TlsConfig(), peer_auth.MEMSVC_POLICY) == []
