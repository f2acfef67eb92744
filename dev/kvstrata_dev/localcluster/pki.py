"""Certificates and keys for the local control plane (one throw-away CA per state dir).

Everything is generated with `cryptography`: a CA, the apiserver's serving cert for
127.0.0.1/localhost, the service-account signing key pair, and client certs for the admin
(group system:masters) and for each control-plane component.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)

# name -> (common name, organisation): the identities the apiserver's RBAC sees.
CLIENTS: dict[str, tuple[str, str | None]] = {
    "admin": ("kvstrata-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    # kwok plays every kubelet; masters keeps it simple (it patches nodes, pods and leases).
    "kwok": ("kwok", "system:masters"),
    # the apiserver's client identity towards aggregated APIs and webhooks
    "apiserver-client": ("kube-apiserver", None),
}


@dataclass(frozen=True)
class Pki:
    """Paths of everything a state dir's `pki/` holds."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def serving_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    def client_crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def client_key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _self_signed_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_ca(pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert, key = _self_signed_ca("kvstrata-local-ca")
    _write_key(pki.ca_key, key)
    _write_cert(pki.ca_crt, cert)
    return cert, key


def _leaf(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    usage: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    b = (
        _builder(subject, ca.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def serving_sans(extra_ips: list[str] | None = None) -> list[x509.GeneralName]:
    names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"]
    ips = ["127.0.0.1", *(extra_ips or [])]
    return [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]


def generate(pki: Pki, service_ip: str) -> None:
    """Write a complete PKI into `pki.dir` (overwriting whatever was there)."""
    pki.dir.mkdir(parents=True, exist_ok=True)
    pki.dir.chmod(0o700)
    ca, ca_key = make_ca(pki)
    cert, key = _leaf(
        ca, ca_key, _name("kube-apiserver"), [ExtendedKeyUsageOID.SERVER_AUTH], serving_sans([service_ip])
    )
    _write_cert(pki.serving_crt, cert)
    _write_key(pki.serving_key, key)
    for name, (cn, org) in CLIENTS.items():
        cert, key = _leaf(ca, ca_key, _name(cn, org), [ExtendedKeyUsageOID.CLIENT_AUTH])
        _write_cert(pki.client_crt(name), cert)
        _write_key(pki.client_key(name), key)
    # Service-account tokens are signed with RSA: every consumer of projected tokens accepts RS256.
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa)
    pki.sa_pub.write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


@dataclass(frozen=True)
class ServingCerts:
    ca_crt: Path
    crt: Path
    key: Path


def serving_certs(directory: Path, dns_names: list[str], ips: list[str] | None = None) -> ServingCerts:
    """A fresh CA and a serving cert for `dns_names`/`ips` (e.g. a webhook's `<svc>.<ns>.svc`)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = ServingCerts(directory / "ca.crt", directory / "tls.crt", directory / "tls.key")
    ca, ca_key = _self_signed_ca("kvstrata-serving-ca")
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips or []]
    cert, key = _leaf(
        ca, ca_key, _name(dns_names[0] if dns_names else "server"), [ExtendedKeyUsageOID.SERVER_AUTH], sans
    )
    _write_cert(out.ca_crt, ca)
    _write_cert(out.crt, cert)
    _write_key(out.key, key)
    return out
