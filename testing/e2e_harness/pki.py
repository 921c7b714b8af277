"""A throw-away certificate authority for the test control plane.

Everything is made fresh per run with `cryptography` (no openssl calls): one CA, the
apiserver's serving certificate (loopback SANs plus the in-cluster `kubernetes` Service
names), client certificates whose CN/O are the Kubernetes user/groups, and the RSA key pair
that signs and verifies service-account tokens.
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

_VALID_FOR = dt.timedelta(days=2)


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


class CertificateAuthority:
    """Signs serving and client certificates; files land in `directory`."""

    def __init__(self, directory: Path, name: str = "sluice-e2e-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = directory / "ca.crt"
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def _issue(self, name: str, subject: x509.Name, usage, sans=None) -> CertFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        files = CertFiles(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, files.key)
        return files

    def serving(self, name: str, dns: list[str], ips: list[str]) -> CertFiles:
        sans = [x509.DNSName(d) for d in dns] + [
            x509.IPAddress(ipaddress.ip_address(i)) for i in ips
        ]
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        return self._issue(name, subject, ExtendedKeyUsageOID.SERVER_AUTH, sans)

    def client(self, name: str, user: str, groups: tuple[str, ...] = ()) -> CertFiles:
        """A client certificate: the apiserver reads CN as the user and O as the groups."""
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        subject = x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, user)])
        return self._issue(name, subject, ExtendedKeyUsageOID.CLIENT_AUTH)


def service_account_keys(directory: Path) -> CertFiles:
    """RSA key pair for service-account tokens (`cert` holds the public key)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    files = CertFiles(directory / "sa.pub", directory / "sa.key")
    _write_key(key, files.key)
    files.cert.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return files
