"""The injector's TLS: a private CA and a serving certificate, made with ``cryptography``.

The kube-apiserver calls the webhook over HTTPS and trusts only the ``caBundle`` in the
MutatingWebhookConfiguration. We keep a CA of our own (long-lived, so the caBundle rarely
changes) and issue short-lived serving certificates from it; renewing a serving cert then
needs no change to the webhook configuration.

Keys are ECDSA P-256: generation is instant, and Go's TLS stack (the apiserver) and
Python's ``ssl`` both accept it. A CA the Helm chart made (``genCA``: RSA) is kept and
signs the renewed serving certificates just the same.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVING_DAYS = 365
# Renew well before expiry so a restart during the last month always renews.
RENEW_BEFORE = dt.timedelta(days=30)
# Tolerate clocks that lag the issuer a little (the apiserver checks notBefore).
BACKDATE = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class Bundle:
    """PEM bytes of the CA and of the serving certificate issued by it."""

    ca_cert: bytes
    ca_key: bytes
    cert: bytes
    key: bytes


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption())


def _subject(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(common_name: str = "lease-sidecar-injector-ca",
            days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A self-signed CA that may sign only end-entity certificates; (cert PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_subject(common_name))
        .issuer_name(_subject(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True,
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue_serving(ca_cert_pem: bytes, ca_key_pem: bytes, hosts: Sequence[str],
                  days: int = SERVING_DAYS) -> tuple[bytes, bytes]:
    """A serving certificate for ``hosts`` (DNS names or IP addresses); (cert PEM, key PEM).

    The apiserver matches the webhook's host against the SANs only (never the CN).
    """
    if not hosts:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    # ECDSA for CAs made here; RSA for the one the Helm chart makes with genCA.
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ValueError("the CA key is neither an ECDSA nor an RSA key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_subject(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, key_cert_sign=False,
            crl_sign=False, content_commitment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(_san(hosts), critical=False)
        .add_extension(_authority_key_id(ca_cert), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _authority_key_id(ca: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    """The CA's own key identifier: OpenSSL looks the issuer up by it, and a CA made
    elsewhere (Go's, the chart's genCA) may derive it by another method than ours."""
    try:
        ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        # A CA's key signs, so it is never one of the key-agreement types (X25519, X448)
        # that widen public_key()'s declared type beyond what an issuer can have.
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca.public_key())  # type: ignore[arg-type]  # see the comment above
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def make_bundle(hosts: Sequence[str]) -> Bundle:
    ca_cert, ca_key = make_ca()
    cert, key = issue_serving(ca_cert, ca_key, hosts)
    return Bundle(ca_cert, ca_key, cert, key)


def _covers(cert: x509.Certificate, hosts: Sequence[str]) -> bool:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    present = set(san.get_values_for_type(x509.DNSName))
    present |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return all(str(_normalise(host)) in present for host in hosts)


def _normalise(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def renewal_reason(bundle: Bundle | None, hosts: Sequence[str],
                   now: dt.datetime | None = None) -> str | None:
    """Why ``bundle`` must be (partly) replaced, or None if it is good as it is."""
    if bundle is None or not all((bundle.ca_cert, bundle.ca_key, bundle.cert, bundle.key)):
        return "no certificate yet"
    now = now or _now()
    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_cert)
        cert = x509.load_pem_x509_certificate(bundle.cert)
        serialization.load_pem_private_key(bundle.ca_key, password=None)
        serialization.load_pem_private_key(bundle.key, password=None)
    except ValueError:
        return "unreadable certificate or key"
    if ca.not_valid_after_utc - now < RENEW_BEFORE:
        return "CA expires soon"
    if not _signed_by(cert, ca):
        return "serving certificate not issued by the CA"
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return "serving certificate expires soon"
    if not _covers(cert, hosts):
        return "serving certificate does not name every host"
    return None


def renew(bundle: Bundle | None, hosts: Sequence[str],
          now: dt.datetime | None = None) -> Bundle:
    """A valid bundle for ``hosts``: reuse what is good, keep the CA whenever possible.

    Keeping the CA keeps the webhook configuration's caBundle unchanged, so a serving
    certificate can be renewed without a window where the apiserver distrusts it.
    """
    if renewal_reason(bundle, hosts, now) is None:
        assert bundle is not None
        return bundle
    now = now or _now()
    if bundle is not None and bundle.ca_cert and bundle.ca_key:
        try:
            ca = x509.load_pem_x509_certificate(bundle.ca_cert)
            if ca.not_valid_after_utc - now >= RENEW_BEFORE:
                cert, key = issue_serving(bundle.ca_cert, bundle.ca_key, hosts)
                return Bundle(bundle.ca_cert, bundle.ca_key, cert, key)
        except ValueError:
            pass  # unreadable CA: start over below
    return make_bundle(hosts)
