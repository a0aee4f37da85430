"""Throw-away PEM files for TLS tests: a CA, a server certificate (for localhost/127.0.0.1
unless given other DNS names) and a client certificate, both signed by the CA (the
`cryptography` package; EC keys: fast)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Certs:
    ca: str  # PEM paths
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


LOOPBACK = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


def make_certs(folder: Path, server_dns_names: list[str] | None = None) -> Certs:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("pdserve test CA", ca_key, ca_key, None, [], is_ca=True)
    paths = {"ca": _write(folder / "ca.pem", ca)}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        names = LOOPBACK
        if role == "server" and server_dns_names is not None:
            names = [x509.DNSName(name) for name in server_dns_names]
        cert = _certificate(f"pdserve test {role}", key, ca_key, ca, names, is_ca=False)
        paths[f"{role}_cert"] = _write(folder / f"{role}.pem", cert)
        paths[f"{role}_key"] = _write_key(folder / f"{role}.key", key)
    return Certs(**paths)


def _certificate(
    name: str, key: ec.EllipticCurvePrivateKey, signer: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None, names: list[x509.GeneralName], is_ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:  # the names gRPC checks the dialled address (or --tls-server-name) against
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    return str(path)
