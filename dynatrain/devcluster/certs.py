"""Certificates and keys for a loopback development control plane.

A real kube-apiserver insists on TLS and on identities carried by client
certificates, so the dev cluster mints its own throw-away PKI: one CA, a
serving certificate for the apiserver, one client certificate per identity
(admin, kube-scheduler, kwok) and the key pair that signs service-account
tokens. Everything is written as PEM files into the cluster's temporary
directory and dies with it; nothing here is fit for a real cluster (short
keys are fine, lifetimes are one day).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# One day is ample for a test session or a foreground `dynatrain dev cluster`,
# and a short life makes a leaked file worthless soon.
_LIFETIME = datetime.timedelta(days=1)
# Clocks of the processes and of this one are the same machine's, but the
# apiserver rejects certificates that are not yet valid; back-date a little.
_BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True, kw_only=True)
class ClientIdentity:
    """Who a client certificate says it is; Kubernetes reads CN and O."""

    name: str
    """The certificate's file stem, e.g. ``admin``."""
    user: str
    """Common name: the Kubernetes user name."""
    groups: tuple[str, ...] = ()
    """Organizations: the Kubernetes groups."""


@dataclass(frozen=True, kw_only=True)
class CertPair:
    """Paths of a PEM certificate and its PEM private key."""

    cert: Path
    key: Path


@dataclass(frozen=True, kw_only=True)
class Pki:
    """Every file the control plane needs, as written by :func:`write_pki`."""

    ca: CertPair
    apiserver: CertPair
    clients: dict[str, CertPair]
    """Client certificates by :attr:`ClientIdentity.name`."""
    service_account_key: Path
    """Private key that signs service-account tokens."""
    service_account_pub: Path
    """Its public key, with which the apiserver verifies them."""


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256 keys are generated in microseconds, RSA-2048 in tens of ms;
    # the apiserver accepts both for TLS and client authentication.
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + _LIFETIME)
    )


def _leaf(
    ca_key, ca_name: x509.Name, subject: x509.Name, *,
    usage: ExtendedKeyUsageOID, sans: list[x509.GeneralName] | None = None,
):
    key = _key()
    builder = (
        _builder(subject, ca_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, content_commitment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=False,
            crl_sign=False, encipher_only=False, decipher_only=False,
        ), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def write_pki(
    directory: Path, *, clients: tuple[ClientIdentity, ...], service_ip: str,
) -> Pki:
    """Mint a CA, the apiserver serving pair, ``clients`` and SA keys into ``directory``.

    ``service_ip`` is the first address of the service CIDR: in-cluster
    clients reach the apiserver as the ``kubernetes`` Service there, so it
    belongs in the serving certificate next to the loopback names.
    """
    directory.mkdir(parents=True, exist_ok=True)

    ca_key = _key()
    ca_name = _name("dynatrain-devcluster-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, content_commitment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True,
            crl_sign=True, encipher_only=False, decipher_only=False,
        ), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca = CertPair(cert=directory / "ca.crt", key=directory / "ca.key")
    _write_cert(ca_cert, ca.cert)
    _write_key(ca_key, ca.key)

    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
           "kubernetes.default.svc.cluster.local"]
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip)]
    key, cert = _leaf(ca_key, ca_name, _name("kube-apiserver"),
                      usage=ExtendedKeyUsageOID.SERVER_AUTH, sans=sans)
    apiserver = CertPair(cert=directory / "apiserver.crt", key=directory / "apiserver.key")
    _write_cert(cert, apiserver.cert)
    _write_key(key, apiserver.key)

    pairs: dict[str, CertPair] = {}
    for ident in clients:
        key, cert = _leaf(ca_key, ca_name, _name(ident.user, ident.groups),
                          usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        pair = CertPair(cert=directory / f"{ident.name}.crt", key=directory / f"{ident.name}.key")
        _write_cert(cert, pair.cert)
        _write_key(key, pair.key)
        pairs[ident.name] = pair

    # Service-account tokens are JWTs; RS256 is what every consumer accepts.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_priv, sa_pub = directory / "sa.key", directory / "sa.pub"
    _write_key(sa_key, sa_priv)
    sa_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo,
    ))

    return Pki(ca=ca, apiserver=apiserver, clients=pairs,
               service_account_key=sa_priv, service_account_pub=sa_pub)


def write_serving_pair(ca: CertPair, directory: Path, *, name: str,
                       ips: tuple[str, ...] = ("127.0.0.1",)) -> CertPair:
    """A serving pair for ``ips`` signed by the cluster's CA, as ``tls.crt``/``tls.key`` in
    ``directory`` (the names controller-runtime's servers read): for a component the
    apiserver calls on loopback (Kueue's webhooks)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    sans = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips] + [x509.DNSName("localhost")]
    key, cert = _leaf(ca_key, ca_cert.subject, _name(name),
                      usage=ExtendedKeyUsageOID.SERVER_AUTH, sans=sans)
    pair = CertPair(cert=directory / "tls.crt", key=directory / "tls.key")
    _write_cert(cert, pair.cert)
    _write_key(key, pair.key)
    return pair
