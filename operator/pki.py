"""Each job's mutual-TLS material: two CAs, the certificates they sign, and their rotation.

On a cluster the operator talks to every worker's agent over mutual TLS, with the bearer token
as a second factor. Each job has its own two certificate authorities, so that the
certificate a worker serves with can never be used to call another worker:

* the **client CA** signs only the operator's client certificate (subject CN and DNS SAN
  ``dynatrain-operator``, extended key usage clientAuth); the workers trust it alone;
* the **serving CA** signs the workers' one serving certificate (DNS SANs
  ``*.<job>-workers.<ns>.svc`` and ``*.<job>-workers.<ns>.svc.cluster.local``, extended key
  usage serverAuth); the operator trusts it alone, and dials a worker at its pod IP with
  server name ``<pod>.<job>-workers.<ns>.svc`` (:func:`server_name`).

Two Secrets carry them (:func:`pki_secret`, :func:`tls_secret`), both labelled
``dynatrain.io/job`` and owned by the job: ``<job>-agent-pki`` holds the CAs' keys and the
operator's client certificate and is never mounted in a pod; ``<job>-agent-tls`` holds what a
worker needs (``client-ca.crt``, ``tls.crt``, ``tls.key``) and is mounted read-only at
:data:`~.cluster.TLS_DIR` (the worker's ``--tls-dir``).

Rotation (:func:`advance`, a pure function of the stored state and the time): a certificate
is renewed once less than a third of its lifetime is left (:func:`needs_renewal`). A leaf is
re-issued from the same CA, which both sides already trust, so nothing else changes. A CA is
rolled over in two steps, because the workers learn a new client CA only when the kubelet
updates their mounted Secret (up to a minute or two later): the new CA is first published
next to the old one in the trust bundles, and leaves are signed with it only once it is
:data:`PROPAGATION_S` old; an old CA leaves the bundles when it expires.

With ``spec.agent.issuerRef`` the operator makes no CA: it asks cert-manager for the two
certificates instead (:func:`certificates`) and reads the Secrets cert-manager fills.
"""

from __future__ import annotations

import base64
import datetime
import re
import secrets
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .cluster import JOB_LABEL, owner_reference

CLIENT_NAME = "dynatrain-operator"
"""The name the operator's client certificate carries, and the workers require
(``--tls-client-name``'s default)."""
DEFAULT_CERT_LIFETIME_S = 30 * 86400.0
"""Lifetime of the leaf certificates (``dynatrain operator --cert-lifetime``)."""
CA_LIFETIME_S = 365 * 86400.0
"""Lifetime of a job's CAs (at least three leaf lifetimes)."""
PROPAGATION_S = 180.0
"""How long a new CA is only trusted before it signs: the kubelet's sync period (a minute)
plus its Secret cache, with a margin, so every worker trusts a new client CA before the
operator presents a certificate it signed."""
MIN_CERT_LIFETIME_S = 10.0
CERT_MANAGER_MIN_S = 3600.0
"""cert-manager refuses a Certificate whose duration is under an hour."""
CERT_MANAGER = ("cert-manager.io", "v1", "certificates")
ISSUER_KINDS = ("Issuer", "ClusterIssuer")
# Keys of the two Secrets.
CLIENT_CA, TLS_CRT, TLS_KEY = "client-ca.crt", "tls.crt", "tls.key"
PKI_KEYS = ("client-ca.crt", "client-ca.key", "serving-ca.crt", "serving-ca.key",
            "client.crt", "client.key", "serving.crt", "serving.key")

_KEY_PEM = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----.+?-----END [A-Z ]*PRIVATE KEY-----"
                      rb"\s*", re.S)


class PkiError(ValueError):
    """Stored PKI material cannot be used; the message names the Secret key."""


# -- names -------------------------------------------------------------------------------------
def tls_secret_name(job: str) -> str:
    return f"{job}-agent-tls"


def pki_secret_name(job: str) -> str:
    return f"{job}-agent-pki"


def client_secret_name(job: str) -> str:
    """With an issuerRef: the Secret cert-manager fills with the operator's certificate."""
    return f"{job}-agent-client"


def serving_dns_names(job: str, namespace: str) -> list[str]:
    return [f"*.{job}-workers.{namespace}.svc", f"*.{job}-workers.{namespace}.svc.cluster.local"]


def server_name(pod: str, job: str, namespace: str) -> str:
    """The name the operator verifies a worker's certificate against (it dials the pod IP)."""
    return f"{pod}.{job}-workers.{namespace}.svc"


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s`` or plain seconds -> seconds (at least
    :data:`MIN_CERT_LIFETIME_S`); ValueError naming the value otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a duration; expected a number with an optional "
                         "unit s, m, h or d (e.g. 30d, 12h, 90)")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if seconds < MIN_CERT_LIFETIME_S:
        raise ValueError(f"{text!r} is {seconds:g} s; a certificate lifetime must be at least "
                         f"{MIN_CERT_LIFETIME_S:g} s")
    return seconds


# -- certificates ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyPair:
    cert: bytes
    """PEM certificate."""
    key: bytes
    """PEM private key (PKCS#8)."""

    @property
    def x509(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert)


def _backdate(lifetime_s: float) -> datetime.timedelta:
    """notBefore lies a little in the past: another node's clock may be behind ours."""
    return datetime.timedelta(seconds=min(60.0, lifetime_s / 10))


def _build(subject: x509.Name, issuer: x509.Name, public_key, signing_key, *, now, lifetime_s,
           not_after_cap=None) -> x509.CertificateBuilder:
    not_before = now - _backdate(lifetime_s)
    not_after = now + datetime.timedelta(seconds=lifetime_s)
    if not_after_cap is not None:             # a leaf never outlives the CA that signed it
        not_after = min(not_after, not_after_cap)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                           critical=False))


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_ca(common_name: str, *, now: datetime.datetime, lifetime_s: float) -> KeyPair:
    """A self-signed CA (ECDSA P-256) that may sign leaves only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    # A random suffix: a rolled-over CA has another subject than the one it replaces.
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                         f"{common_name} {secrets.token_hex(4)}"[:64])])
    cert = (_build(name, name, key.public_key(), key, now=now, lifetime_s=lifetime_s)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(ca: KeyPair, *, common_name: str, dns_names: list[str], server: bool,
          now: datetime.datetime, lifetime_s: float) -> KeyPair:
    """A leaf signed by ``ca``: serverAuth when ``server``, clientAuth otherwise."""
    ca_cert = ca.x509
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (_build(subject, ca_cert.subject, key.public_key(), ca_key, now=now,
                   lifetime_s=lifetime_s, not_after_cap=ca_cert.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_cert.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def _cert(cert_pem: bytes | x509.Certificate) -> x509.Certificate:
    return cert_pem if isinstance(cert_pem, x509.Certificate) else \
        x509.load_pem_x509_certificate(cert_pem)


def renewal_time(cert_pem: bytes | x509.Certificate) -> datetime.datetime:
    """When a third of the certificate's lifetime is left."""
    c = _cert(cert_pem)
    return c.not_valid_after_utc - (c.not_valid_after_utc - c.not_valid_before_utc) / 3


def needs_renewal(cert_pem: bytes | x509.Certificate, now: datetime.datetime) -> bool:
    """True when less than a third of the certificate's lifetime is left (or it expired)."""
    return now >= renewal_time(cert_pem)


def _signed_by(leaf: KeyPair, ca: KeyPair) -> bool:
    try:
        aki = leaf.x509.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        ski = ca.x509.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return False
    return aki.key_identifier == ski.digest


# -- one job's material ------------------------------------------------------------------------
@dataclass(frozen=True)
class JobPki:
    client_cas: tuple[KeyPair, ...]
    """Newest first: the client CA being rolled in, then the one it replaces (if any)."""
    serving_cas: tuple[KeyPair, ...]
    client: KeyPair
    """The operator's client certificate."""
    serving: KeyPair
    """The workers' serving certificate."""

    @property
    def client_ca_bundle(self) -> bytes:
        """What the workers trust as callers' CAs (``client-ca.crt``)."""
        return b"".join(ca.cert for ca in self.client_cas)

    @property
    def serving_ca_bundle(self) -> bytes:
        """What the operator trusts as the agents' CAs."""
        return b"".join(ca.cert for ca in self.serving_cas)


def _signer(cas: tuple[KeyPair, ...], now: datetime.datetime,
            propagation_s: float) -> KeyPair:
    """The newest CA that every worker trusts by now (published ``propagation_s`` ago); the
    oldest one while none is that old (a job's first CA signs at once: nothing used it)."""
    for ca in cas:
        if (now - ca.x509.not_valid_before_utc).total_seconds() >= propagation_s:
            return ca
    return cas[-1]


def _roll(cas: tuple[KeyPair, ...], name: str, now, ca_lifetime_s: float,
          changes: list[str]) -> tuple[KeyPair, ...]:
    kept = tuple(ca for ca in cas if ca.x509.not_valid_after_utc > now)
    if len(kept) < len(cas):
        changes.append(f"dropped {len(cas) - len(kept)} expired {name}")
    if not kept or needs_renewal(kept[0].cert, now):
        changes.append(f"new {name}")
        kept = (new_ca(name, now=now, lifetime_s=ca_lifetime_s),) + kept[:1]
    return kept


def advance(pki: JobPki | None, *, job: str, namespace: str, now: datetime.datetime,
            lifetime_s: float = DEFAULT_CERT_LIFETIME_S,
            propagation_s: float = PROPAGATION_S) -> tuple[JobPki, list[str]]:
    """The job's PKI as it should be at ``now``, and what changed (empty: nothing).

    Missing: both CAs and both leaves are made. Otherwise a CA with less than a third of its
    life left gets a successor (both are trusted; see :func:`_signer` for when it signs), an
    expired CA is dropped, and a leaf is re-issued when it needs renewal or was not signed by
    its kind's current signing CA."""
    ca_lifetime_s = max(CA_LIFETIME_S, 3 * lifetime_s)
    changes: list[str] = []
    if pki is None:
        changes.append("created the client and serving CAs")
        client_cas = (new_ca(f"dynatrain {job} client CA", now=now, lifetime_s=ca_lifetime_s),)
        serving_cas = (new_ca(f"dynatrain {job} serving CA", now=now,
                              lifetime_s=ca_lifetime_s),)
        client = serving = None
    else:
        client_cas = _roll(pki.client_cas, f"dynatrain {job} client CA", now, ca_lifetime_s,
                           changes)
        serving_cas = _roll(pki.serving_cas, f"dynatrain {job} serving CA", now,
                            ca_lifetime_s, changes)
        client, serving = pki.client, pki.serving
    signer = _signer(client_cas, now, propagation_s)
    if client is None or needs_renewal(client.cert, now) or not _signed_by(client, signer):
        changes.append("issued the operator's client certificate")
        client = issue(signer, common_name=CLIENT_NAME, dns_names=[CLIENT_NAME], server=False,
                       now=now, lifetime_s=lifetime_s)
    signer = _signer(serving_cas, now, propagation_s)
    if serving is None or needs_renewal(serving.cert, now) or not _signed_by(serving, signer):
        changes.append("issued the workers' serving certificate")
        names = serving_dns_names(job, namespace)
        serving = issue(signer, common_name=names[0], dns_names=names, server=True, now=now,
                        lifetime_s=lifetime_s)
    return JobPki(client_cas, serving_cas, client, serving), changes


def next_change(pki: JobPki, propagation_s: float = PROPAGATION_S) -> datetime.datetime:
    """The earliest time :func:`advance` would change ``pki``: a renewal point, a new CA
    starting to sign, an old one expiring."""
    times = []
    for cas, leaf in ((pki.client_cas, pki.client), (pki.serving_cas, pki.serving)):
        times += [renewal_time(leaf.cert), renewal_time(cas[0].cert)]
        times += [ca.x509.not_valid_after_utc for ca in cas[1:]]
        if len(cas) > 1 and not _signed_by(leaf, cas[0]):      # the new CA starts to sign
            times.append(cas[0].x509.not_valid_before_utc
                         + datetime.timedelta(seconds=propagation_s))
    return min(times)


# -- Secrets -----------------------------------------------------------------------------------
def _secret(body, name: str, data: dict[str, bytes], kind: str = "Opaque") -> dict:
    job = body["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Secret", "type": kind,
            "metadata": {"name": name, "labels": {JOB_LABEL: job},
                         "ownerReferences": [owner_reference(body)]},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def pki_secret(body, pki: JobPki) -> dict:
    """``<job>-agent-pki``: the CAs with their keys, the operator's client certificate and the
    workers' serving certificate (the source of ``<job>-agent-tls``). Never mounted."""
    data = {"client-ca.crt": pki.client_ca_bundle,
            "client-ca.key": b"".join(ca.key for ca in pki.client_cas),
            "serving-ca.crt": pki.serving_ca_bundle,
            "serving-ca.key": b"".join(ca.key for ca in pki.serving_cas),
            "client.crt": pki.client.cert, "client.key": pki.client.key,
            "serving.crt": pki.serving.cert, "serving.key": pki.serving.key}
    return _secret(body, pki_secret_name(body["metadata"]["name"]), data)


def tls_secret(body, pki: JobPki) -> dict:
    """``<job>-agent-tls``: what a worker mounts at :data:`~.cluster.TLS_DIR`."""
    return _secret(body, tls_secret_name(body["metadata"]["name"]),
                   {CLIENT_CA: pki.client_ca_bundle, TLS_CRT: pki.serving.cert,
                    TLS_KEY: pki.serving.key}, kind="kubernetes.io/tls")


def secret_bytes(data: dict | None) -> dict[str, bytes]:
    """A Secret's ``data`` (base64, as the API returns it) decoded."""
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def from_secret(data: dict[str, bytes], where: str) -> JobPki:
    """The PKI stored by :func:`pki_secret`; :class:`PkiError` naming the key if unusable."""
    missing = [k for k in PKI_KEYS if not data.get(k)]
    if missing:
        raise PkiError(f"{where} lacks {', '.join(missing)}")

    def cas(kind: str) -> tuple[KeyPair, ...]:
        try:
            certs = x509.load_pem_x509_certificates(data[f"{kind}-ca.crt"])
        except ValueError as e:
            raise PkiError(f"{where}: {kind}-ca.crt is not PEM certificates: {e}") from None
        keys = _KEY_PEM.findall(data[f"{kind}-ca.key"])
        if len(keys) != len(certs):
            raise PkiError(f"{where}: {kind}-ca.crt holds {len(certs)} certificates but "
                           f"{kind}-ca.key {len(keys)} keys")
        return tuple(KeyPair(c.public_bytes(serialization.Encoding.PEM), k.strip() + b"\n")
                     for c, k in zip(certs, keys))

    pki = JobPki(cas("client"), cas("serving"), KeyPair(data["client.crt"], data["client.key"]),
                 KeyPair(data["serving.crt"], data["serving.key"]))
    for name in ("client.crt", "serving.crt"):
        try:
            x509.load_pem_x509_certificate(data[name])
        except ValueError as e:
            raise PkiError(f"{where}: {name} is not a PEM certificate: {e}") from None
    return pki


# -- cert-manager ------------------------------------------------------------------------------
def certificates(body, ref: dict, lifetime_s: float = DEFAULT_CERT_LIFETIME_S) -> list[dict]:
    """The cert-manager ``Certificate`` objects (cert-manager.io/v1) of a job whose
    ``spec.agent.issuerRef`` names an Issuer: the workers' serving certificate (Secret
    ``<job>-agent-tls``) and the operator's client certificate (``<job>-agent-client``).
    cert-manager renews each a third of its lifetime before it expires (as :func:`advance`
    does), with a new key every time."""
    job, ns = body["metadata"]["name"], body["metadata"]["namespace"]
    lifetime_s = max(lifetime_s, CERT_MANAGER_MIN_S)
    common = {"duration": f"{int(lifetime_s)}s", "renewBefore": f"{int(lifetime_s / 3)}s",
              "issuerRef": dict(ref),
              "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
              "secretTemplate": {"labels": {JOB_LABEL: job}}}

    def certificate(name: str, spec: dict) -> dict:
        return {"apiVersion": "cert-manager.io/v1", "kind": "Certificate",
                "metadata": {"name": name, "labels": {JOB_LABEL: job},
                             "ownerReferences": [owner_reference(body)]},
                "spec": {"secretName": name, **common, **spec}}

    return [certificate(tls_secret_name(job), {
                "dnsNames": serving_dns_names(job, ns),
                "usages": ["server auth", "digital signature"]}),
            certificate(client_secret_name(job), {
                "commonName": CLIENT_NAME, "dnsNames": [CLIENT_NAME],
                "usages": ["client auth", "digital signature"]})]


CERT_MANAGER_TLS_ITEMS = {"ca.crt": CLIENT_CA, TLS_CRT: TLS_CRT, TLS_KEY: TLS_KEY}
"""How a worker pod mounts cert-manager's Secret: its ``ca.crt`` (the Issuer's CA, which
signed the operator's certificate too) becomes the workers' ``client-ca.crt``."""
OWN_TLS_ITEMS = {CLIENT_CA: CLIENT_CA, TLS_CRT: TLS_CRT, TLS_KEY: TLS_KEY}
