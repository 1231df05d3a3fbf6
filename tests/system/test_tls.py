"""Security with real processes: mutual TLS between memsvc, the executor and the gateway
(certificates made here with `cryptography`), TLS and an API key on the public API,
loopback-only listeners by default, the pool's shared memory readable by its owner only."""
import datetime
import glob
import ipaddress
import os
import stat

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagedserve.wire.v1 import generation_pb2 as pb
from pagedserve.wire.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.v1 import memory_pb2, memory_pb2_grpc
from tests.support.gateway_harness import collect, greedy
from tests.support.health import SERVING, health
from tests.support.reliability_procs import serving_stack

KEY = "s3cret-key"


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca_key, ca_cert, cn):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def write(path, key, cert):
    with open(path + ".key", "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(path + ".crt", "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return path + ".crt", path + ".key"


def pem(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca_key, ca = make_ca("pagedserve test CA")
    ca_path = str(d / "ca.crt")
    with open(ca_path, "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    out = {"ca": ca_path}
    for name in ("memsvc", "executor", "gateway", "client"):
        out[name] = write(str(d / name), *make_leaf(ca_key, ca, name))
    rogue_key, rogue_ca = make_ca("someone else")
    out["rogue"] = write(str(d / "rogue"), *make_leaf(rogue_key, rogue_ca, "rogue"))
    return out


def tls(certs, name):
    cert, key = certs[name]
    return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", certs["ca"]]


@pytest.fixture(scope="module")
def stack(certs, tmp_path_factory):
    public = grpc.ssl_channel_credentials(root_certificates=pem(certs["ca"]))
    with serving_stack(str(tmp_path_factory.mktemp("tls")), credentials=public, kv_tokens=1024,
                       memsvc_args=tls(certs, "memsvc"), executor_args=tls(certs, "executor"),
                       gateway_args=tls(certs, "gateway"), env={"PAGEDSERVE_API_KEY": KEY},
                       token=None) as s:  # mutual TLS alone closes memsvc and the executor
        s.public = public
        yield s


def client_credentials(certs, name=None):
    if name is None:
        return grpc.ssl_channel_credentials(root_certificates=pem(certs["ca"]))
    cert, key = certs[name]
    return grpc.ssl_channel_credentials(root_certificates=pem(certs["ca"]), private_key=pem(key),
                                        certificate_chain=pem(cert))


def test_the_public_api_speaks_tls_and_wants_the_key(stack):
    with grpc.secure_channel(stack.gateway, stack.public) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(prompt="Hello", sampling=greedy(3))
        out = collect(stub.Generate(req, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]))
        assert out[0]["finish_reason"] == "length"
        assert collect(stub.Generate(req, timeout=30, metadata=[("x-api-key", KEY)]))[0]["token_ids"]
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", KEY)]):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30, metadata=md))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health(stack.gateway, "pagedserve.v1.Generation", stack.public) == SERVING  # no key needed
    assert health(stack.gateway) is None  # plaintext gets nowhere


def test_internal_services_want_a_client_certificate_from_their_ca(stack, certs):
    def stats(credentials):
        channel = grpc.secure_channel(stack.memsvc, credentials) if credentials else grpc.insecure_channel(stack.memsvc)
        with channel:
            return memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=5)

    assert stats(client_credentials(certs, "gateway")).num_blocks == 64
    # Signed by the CA but not a gateway (its CN names no role): refused (pagedserve.rpc.peer_auth).
    with pytest.raises(grpc.RpcError) as e:
        stats(client_credentials(certs, "client"))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    for credentials in (None, client_credentials(certs), client_credentials(certs, "rogue")):
        with pytest.raises(grpc.RpcError) as e:
            stats(credentials)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health(stack.executor, tls=client_credentials(certs, "client")) == SERVING
    assert health(stack.executor, tls=client_credentials(certs)) is None


def _address(hexhost: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp[6] writes it (32-bit words, little-endian)."""
    raw = b"".join(bytes.fromhex(hexhost[i:i + 8])[::-1] for i in range(0, len(hexhost), 8))
    addr = ipaddress.ip_address(raw)
    return getattr(addr, "ipv4_mapped", None) or addr


def _listening_hosts(port: int) -> set:
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                host, hexport = local.rsplit(":", 1)
                if int(hexport, 16) == port and state == "0A":  # LISTEN
                    hosts.add(_address(host))
    return hosts


def test_services_listen_on_loopback_by_default(stack):
    import argparse

    from pagedserve.service_cmds import SERVICES
    from pagedserve.wire.settings import add_flags

    for cls, _, _ in SERVICES.values():
        p = argparse.ArgumentParser()
        add_flags(p, cls)
        assert p.parse_args([]).host == "127.0.0.1"
    for name in ("memsvc", "executor", "gateway", "memsvc_metrics", "executor_metrics", "gateway_metrics"):
        assert _listening_hosts(stack.ports[name]) == {ipaddress.ip_address("127.0.0.1")}, name


def test_the_pool_segment_is_readable_by_its_owner_only(stack):
    [segment] = glob.glob(f"/dev/shm/pagedserve-kv-{stack.procs['memsvc'].pid}-*")
    info = os.stat(segment)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
