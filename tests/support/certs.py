"""Certificates for tests: a CA and leaves signed by it, with the role URI pagedserve.rpc.peer_auth reads
(`spiffe://pagedserve/<role>`), made with `cryptography`."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _validity(builder):
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1))


def make_ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_validity(x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                      .public_key(key.public_key()).serial_number(x509.random_serial_number()))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca_key, ca_cert, cn: str, roles: tuple[str, ...] = ()):
    """A server-and-client certificate for localhost/127.0.0.1 with a role URI per role."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    names += [x509.UniformResourceIdentifier(f"spiffe://pagedserve/{r}") for r in roles]
    cert = (_validity(x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
                      .public_key(key.public_key()).serial_number(x509.random_serial_number()))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def write_pair(path: str, key, cert) -> tuple[str, str]:
    """Write PATH.crt and PATH.key; return (cert path, key path)."""
    Path(path + ".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    Path(path + ".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path + ".crt", path + ".key"


def make_cert_dir(directory, leaves: dict[str, tuple[str, ...]]) -> dict:
    """A CA (`ca`: its path) and, per name in `leaves`, (cert, key) paths of a leaf with those
    roles; `rogue`: a leaf with every role signed by another CA."""
    d = Path(directory)
    ca_key, ca = make_ca("pagedserve test CA")
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out: dict = {"ca": str(d / "ca.crt")}
    for name, roles in leaves.items():
        out[name] = write_pair(str(d / name), *make_leaf(ca_key, ca, name, roles))
    rogue_key, rogue_ca = make_ca("someone else")
    out["rogue"] = write_pair(str(d / "rogue"), *make_leaf(rogue_key, rogue_ca, "rogue",
                                                           ("gateway", "executor")))
    return out


def tls_args(certs: dict, name: str) -> list[str]:
    cert, key = certs[name]
    return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", certs["ca"]]
