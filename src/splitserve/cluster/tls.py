"""Certificates for ``splitserve serve --tls``: a private CA made for one deployment and one
server certificate that every worker and the router of it serve with.

The CA's private key never touches the disk. Locally it signs the one server certificate and
is dropped, so nothing can mint another certificate this CA vouches for. On Ray
(``DeploymentCA``) it lives in the controller's memory for the deployment's life and signs a
certificate for each node a process lands on, which that node's ``ProcessHost`` writes to a
private directory of its own. What is written goes to a fresh directory only its owner can
enter (mode 0700), a server's key with mode 0600; its owner removes it when done.

::

    <dir>/ca.pem      the CA certificate: what clients trust (SSL_CERT_FILE, --ca, verify=)
    <dir>/server.pem  the server certificate; names: the host, 127.0.0.1, localhost
    <dir>/server.key  its private key (0600)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any deployment's life; the directory (and the CA) ends with the launcher.
VALIDITY = datetime.timedelta(days=30)
CLOCK_SKEW = datetime.timedelta(hours=1)  # not-before in the past: clients with a slow clock


@dataclass(frozen=True, slots=True)
class DeploymentTLS:
    """One deployment's certificate files (see the module's docstring)."""

    dir: str
    ca: str
    cert: str
    key: str

    def server_args(self) -> list[str]:
        """The flags a worker or router serves HTTPS with and verifies its peers by."""
        return ["--ssl-certfile", self.cert, "--ssl-keyfile", self.key, "--worker-ca", self.ca]

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class DeploymentCA:
    """A private CA held in memory: its certificate (``ca_pem``) and server certificates it
    signs on demand (``issue``)."""

    def __init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = _ca_certificate(self._key)
        self.ca_pem = self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, hosts: Sequence[str] = ()) -> dict[str, bytes]:
        """A new key and a certificate for ``hosts`` (plus 127.0.0.1 and localhost), with the
        CA's: ``{"ca.pem", "server.pem", "server.key"}``, PEM."""
        names = list(dict.fromkeys([*hosts, "127.0.0.1", "localhost"]))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _server_certificate(key, names, self._key, self._cert)
        pem_key = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return {
            "ca.pem": self.ca_pem,
            "server.pem": cert.public_bytes(serialization.Encoding.PEM),
            "server.key": pem_key,
        }


def private_tls(hosts: Sequence[str] = ()) -> DeploymentTLS:
    """A new CA and a server certificate for ``hosts`` (plus 127.0.0.1 and localhost),
    written to a new private temporary directory; ``remove()`` it when done. The CA's key
    is dropped on return."""
    out = write_private(DeploymentCA().issue(hosts))
    return DeploymentTLS(
        out, *(os.path.join(out, n) for n in ("ca.pem", "server.pem", "server.key"))
    )


def write_private(files: dict[str, bytes], prefix: str = "splitserve-tls-") -> str:
    """``files`` (name -> bytes) in a new temporary directory named ``prefix...`` of mode
    0700, ``*.key`` files 0600 and the rest 0644; the directory."""
    out = tempfile.mkdtemp(prefix=prefix)  # mode 0700
    try:
        for name, data in files.items():
            _write(os.path.join(out, name), data, 0o600 if name.endswith(".key") else 0o644)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitserve deployment CA")])
    usage = _key_usage(digital_signature=False, key_cert_sign=True, crl_sign=True)
    return (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )


def _server_certificate(
    key: ec.EllipticCurvePrivateKey,
    names: list[str],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    usage = _key_usage(digital_signature=True, key_cert_sign=False, crl_sign=False)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
    )


def _key_usage(digital_signature: bool, key_cert_sign: bool, crl_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
