"""The injector's CA and serving certificates, checked with a real TLS handshake."""

from __future__ import annotations

import datetime as dt
import hashlib
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sidecar.injector import certs
from sidecar.injector.tls import write_pem

HOSTS = ["inj.ns.svc", "inj.ns.svc.cluster.local", "127.0.0.1"]


def _load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def test_bundle_is_a_ca_and_a_serving_cert_it_signed() -> None:
    bundle = certs.make_bundle(HOSTS)
    ca, cert = _load(bundle.ca_cert), _load(bundle.cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    cert.verify_directly_issued_by(ca)
    leaf = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert leaf.ca is False
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == HOSTS[:2]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert certs.renewal_reason(bundle, HOSTS) is None


def test_tls_handshake_verifies_against_the_ca(tmp_path: Path) -> None:
    """A real TLS server with the written PEM: a client trusting the CA connects, a client
    trusting another CA is refused."""
    _handshake(certs.make_bundle(["localhost", "127.0.0.1"]), tmp_path)


def _foreign_rsa_ca() -> tuple[bytes, bytes]:
    """A CA shaped like the one the Helm chart makes with genCA (Go's x509): RSA, a PKCS#1
    key, and a subject key identifier Go derives with SHA-256, not SHA-1 like ours."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lease-sidecar-injector-ca")])
    public_bits = key.public_key().public_bytes(serialization.Encoding.DER,
                                                serialization.PublicFormat.PKCS1)
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier(hashlib.sha256(public_bits).digest()[:20]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM,
                              serialization.PrivateFormat.TraditionalOpenSSL,
                              serialization.NoEncryption()))


def test_a_ca_made_by_the_chart_is_kept_and_verifies(tmp_path: Path) -> None:
    """Before: an RSA CA was thrown away ("not an ECDSA key"), and a serving certificate
    naming our own hash of the CA key as its authority was refused by OpenSSL."""
    ca_cert, ca_key = _foreign_rsa_ca()
    renewed = certs.renew(certs.Bundle(ca_cert, ca_key, b"", b""), ["localhost", "127.0.0.1"])
    assert renewed.ca_cert == ca_cert and renewed.ca_key == ca_key
    _handshake(renewed, tmp_path)


def _handshake(bundle: certs.Bundle, tmp_path: Path) -> None:
    pem = write_pem(bundle, tmp_path / "tls")
    assert pem.read_bytes() == bundle.key + bundle.cert
    assert pem.parent.stat().st_mode & 0o777 == 0o700
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(pem, pem)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]

        def serve() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                try:
                    with server_ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"ok")
                except (ssl.SSLError, OSError):
                    pass  # the distrusting client hangs up mid-handshake

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        trusting = ssl.create_default_context(cadata=bundle.ca_cert.decode())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                trusting.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.recv(2) == b"ok"
        stranger = ssl.create_default_context(cadata=certs.make_ca()[0].decode())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                pytest.raises(ssl.SSLCertVerificationError):
            stranger.wrap_socket(raw, server_hostname="localhost")
        thread.join(5)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda b: None, "no certificate yet"),
        (lambda b: certs.Bundle(b.ca_cert, b.ca_key, b"", b.key), "no certificate yet"),
        (lambda b: certs.Bundle(b.ca_cert, b.ca_key, b"junk", b.key),
         "unreadable certificate or key"),
        (lambda b: certs.Bundle(certs.make_ca()[0], b.ca_key, b.cert, b.key),
         "serving certificate not issued by the CA"),
    ],
    ids=["none", "empty", "junk", "foreign-ca"],
)
def test_renewal_reasons(change, reason: str) -> None:
    assert certs.renewal_reason(change(certs.make_bundle(HOSTS)), HOSTS) == reason


def test_missing_host_renews_the_serving_cert_but_keeps_the_ca() -> None:
    bundle = certs.make_bundle(HOSTS[:1])
    wanted = [*HOSTS[:1], "inj.other.svc"]
    assert certs.renewal_reason(bundle, wanted) == "serving certificate does not name every host"
    renewed = certs.renew(bundle, wanted)
    assert renewed.ca_cert == bundle.ca_cert and renewed.ca_key == bundle.ca_key
    assert renewed.cert != bundle.cert
    assert certs.renewal_reason(renewed, wanted) is None
    assert certs.renew(renewed, wanted) is renewed  # nothing to do: the same object


def test_expiry_renews_the_serving_cert_then_the_ca() -> None:
    bundle = certs.make_bundle(HOSTS)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=certs.SERVING_DAYS - 29)
    assert certs.renewal_reason(bundle, HOSTS, later) == "serving certificate expires soon"
    renewed = certs.renew(bundle, HOSTS, later)
    assert renewed.ca_cert == bundle.ca_cert and renewed.cert != bundle.cert

    much_later = dt.datetime.now(dt.UTC) + dt.timedelta(days=certs.CA_DAYS - 29)
    assert certs.renewal_reason(bundle, HOSTS, much_later) == "CA expires soon"
    assert certs.renew(bundle, HOSTS, much_later).ca_cert != bundle.ca_cert


def test_serving_cert_never_outlives_its_ca() -> None:
    ca_cert, ca_key = certs.make_ca(days=10)
    cert, _ = certs.issue_serving(ca_cert, ca_key, HOSTS, days=365)
    assert _load(cert).not_valid_after_utc <= _load(ca_cert).not_valid_after_utc


def test_no_hosts_is_an_error() -> None:
    ca_cert, ca_key = certs.make_ca()
    with pytest.raises(ValueError, match="at least one DNS name or IP"):
        certs.issue_serving(ca_cert, ca_key, [])
