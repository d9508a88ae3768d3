"""Caller authentication of the agent's gRPC server, and the matching client-side helpers.

The agent runs inside a training process and can stop, reshape or crash the job, so every call
but the health probe must come from the controller. Two mechanisms, usable alone or together:

* **Bearer token.** The operator mounts a Secret holding a token into the worker pod and the
  controller's pod; callers send ``authorization: Bearer <token>`` metadata and
  :class:`BearerTokenInterceptor` compares it, in constant time, with the token file. The file
  is re-read whenever it changes on disk, because Kubernetes updates mounted Secrets in place
  when they are rotated, and the agent lives as long as the training run.
* **Mutual TLS.** :func:`server_credentials` requires a client certificate signed by the given
  CA; :func:`channel_credentials` builds the controller's side from PEM files
  (:class:`TlsFiles`) or from bytes held in memory (:class:`ClientTls`, what the operator reads
  from its job's PKI Secret). On a cluster the worker serves from a directory
  (:class:`ServerTlsDir`: ``tls.crt``, ``tls.key``, ``client-ca.crt``, a mounted Secret) whose
  files are re-read when they change, so a rotated certificate reaches new connections without
  a restart; and the caller's certificate must also *name* the operator
  (:func:`client_name_problem`: its subject CN or a DNS SAN), since a certificate signed by
  the client CA is not enough on its own if that CA ever signs anything else. The re-read
  costs every new connection a wait for the GIL in a busy training process (see
  :class:`ServerTlsDir`), so a client must not cut a connection attempt short.

The standard health service (``/grpc.health.v1.Health/``) stays open without a token: kubelet
probes and load balancers cannot send one, and it discloses nothing beyond "serving". (Over
TLS the handshake still needs a client certificate, which the kubelet cannot present: the
agent's server therefore also serves health alone on a plaintext port, see
:func:`dynatrain.agent.server.serve`.)
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"  # gRPC metadata keys are lower-case
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class AuthConfigError(ValueError):
    """A credential file is missing, unreadable or empty; the message names the path."""


# ----------------------------------------------------------------------------------------------
# Bearer token


def read_token(path: str | os.PathLike) -> str:
    """The token in ``path`` with surrounding whitespace stripped (Secrets often end in \\n)."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise AuthConfigError(f"cannot read the token file {str(path)!r}: {e.strerror or e}") \
            from None
    except UnicodeDecodeError:
        raise AuthConfigError(f"the token file {str(path)!r} is not UTF-8 text") from None
    if not token:
        raise AuthConfigError(f"the token file {str(path)!r} is empty; it must hold the "
                              "bearer token (the operator mounts it from a Secret)")
    return token


class TokenFile:
    """A token file, re-read when it changes on disk.

    The file must hold a token when this object is made (:class:`AuthConfigError` otherwise,
    naming the path). Afterwards a change of the file's modification time, size or inode (a
    Kubernetes Secret update swaps a symlink to a new file) makes the next :meth:`get` read it
    again. If that read fails or finds the file empty, the last good token stays in force and
    a warning is logged: a Secret update is atomic, so this is a transient state of some
    other writer, and failing every call of a running training job over it would do harm.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._token = read_token(self.path)

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)  # follows the symlinks of a mounted Secret
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def get(self) -> str:
        """The current token (one ``stat`` per call; the file is read only when it changed)."""
        signature = self._stat()
        if signature == self._signature:
            return self._token
        with self._lock:
            if signature != self._signature:
                try:
                    self._token = read_token(self.path)
                    log.info("re-read the token file %s after it changed", self.path)
                except AuthConfigError as e:
                    log.warning("%s; keeping the previous token", e)
                self._signature = signature
            return self._token


def _abort_handler(code: grpc.StatusCode, details: str,
                   like: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler that fails the call with ``code``, of the same kind (unary/stream) as ``like``.

    It has no request deserializer, so an unauthenticated payload is never parsed.
    """
    def unary(request, context):
        context.abort(code, details)

    def stream(request_iterator, context):
        context.abort(code, details)

    if like is None or not (like.request_streaming or like.response_streaming):
        return grpc.unary_unary_rpc_method_handler(unary)
    if like.request_streaming and like.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if like.request_streaming:
        return grpc.stream_unary_rpc_method_handler(stream)
    return grpc.unary_stream_rpc_method_handler(unary)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects, with UNAUTHENTICATED, every call without the right bearer token.

    ``token_file`` is a path or a :class:`TokenFile`. Methods under ``open_prefixes`` (the
    health service by default) need no token. The error's details say what was missing or
    wrong, and never contain the token that was sent or expected.
    """

    def __init__(self, token_file: str | os.PathLike | TokenFile,
                 open_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)):
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        self.open_prefixes = tuple(open_prefixes)

    def check(self, metadata) -> str | None:
        """Why ``metadata`` (a sequence of (key, value)) is refused, or None if it is accepted."""
        values = [v for k, v in (metadata or ()) if k.lower() == AUTH_HEADER]
        if not values:
            return (f"missing {AUTH_HEADER!r} metadata; expected "
                    f"'{AUTH_HEADER}: Bearer <token>' (or use mutual TLS)")
        if len(values) > 1:
            return f"{len(values)} {AUTH_HEADER!r} metadata entries; send exactly one"
        value = values[0]
        if isinstance(value, bytes):  # only keys ending in -bin carry bytes; be lenient
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer":
            return (f"{AUTH_HEADER!r} metadata does not use the Bearer scheme; expected "
                    f"'Bearer <token>'")
        token = token.strip()
        if not token:
            return f"{AUTH_HEADER!r} metadata has the Bearer scheme but no token"
        expected = self.token_file.get()
        # Constant-time comparison on bytes (compare_digest on str accepts only ASCII).
        if not hmac.compare_digest(token.encode("utf-8"), expected.encode("utf-8")):
            return "wrong bearer token"
        return None

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self.open_prefixes):
            return continuation(handler_call_details)
        problem = self.check(handler_call_details.invocation_metadata)
        if problem is None:
            return continuation(handler_call_details)
        log.warning("refused %s: %s", method, problem)
        # The handler we return must match the method's kind, so ask for the real one; an
        # unknown method gets UNAUTHENTICATED too, so that probing learns nothing.
        return _abort_handler(grpc.StatusCode.UNAUTHENTICATED,
                              problem, continuation(handler_call_details))


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``; pass as ``metadata=`` on any channel."""
    return ((AUTH_HEADER, f"Bearer {token}"),)


class _TokenPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, token: Callable[[], str]):
        self._token = token

    def __call__(self, context, callback):
        try:
            callback(bearer_metadata(self._token()), None)
        except Exception as e:  # reported to the caller as the call's failure
            callback((), e)


def token_call_credentials(token: str | TokenFile | Callable[[], str]) -> grpc.CallCredentials:
    """Call credentials sending the bearer token (fetched per call from a TokenFile/callable).

    gRPC sends call credentials only over secure channels; over a plaintext channel use
    :func:`bearer_metadata` instead (``AgentClient`` does that itself).
    """
    if isinstance(token, str):
        def source(value: str = token) -> str:
            return value
    elif isinstance(token, TokenFile):
        source = token.get
    else:
        source = token
    return grpc.metadata_call_credentials(_TokenPlugin(source), name="dynatrain-bearer")


# ----------------------------------------------------------------------------------------------
# Mutual TLS


def _read_pem(path: str | os.PathLike, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AuthConfigError(f"cannot read the {what} {str(path)!r}: {e.strerror or e}") \
            from None
    if b"-----BEGIN" not in data:
        raise AuthConfigError(f"the {what} {str(path)!r} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one side of a mutual-TLS connection.

    ``ca`` is the CA that signs the *other* side's certificates; ``cert``/``key`` are this
    side's certificate chain and private key (a server needs them; a client needs them to be
    accepted by an mTLS server). ``server_name``, on the client side only, is the name to
    verify the server's certificate against when it differs from the dialled address (a pod
    dialled by IP whose certificate names its Service).
    """

    ca: str | os.PathLike
    cert: str | os.PathLike | None = None
    key: str | os.PathLike | None = None
    server_name: str | None = None


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate signed by ``tls.ca``."""
    if tls.cert is None or tls.key is None:
        raise AuthConfigError("a TLS server needs both a certificate and a key "
                              f"(got cert={tls.cert!r}, key={tls.key!r})")
    chain = _read_pem(tls.cert, "server certificate")
    key = _read_pem(tls.key, "server private key")
    ca = _read_pem(tls.ca, "client CA certificate")
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                       require_client_auth=True)


@dataclass(frozen=True)
class ClientTls:
    """The client side of mutual TLS, held in memory (PEM bytes).

    ``ca`` is the CA that signs the agents' serving certificates; ``cert``/``key`` the
    client's own certificate chain and private key; ``server_name`` the name to verify the
    server's certificate against when the dialled address (a pod IP) is not in it, e.g.
    ``<pod>.<job>-workers.<namespace>.svc``.
    """

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str | None = None

    def __post_init__(self):
        for what, value in (("ca", self.ca), ("cert", self.cert), ("key", self.key)):
            if not isinstance(value, bytes) or b"-----BEGIN" not in value:
                raise AuthConfigError(f"ClientTls.{what} must be PEM bytes (with a "
                                      f"'-----BEGIN' line); got {type(value).__name__} "
                                      f"of length {len(value) if value is not None else 0}")


def channel_credentials(tls: TlsFiles | ClientTls) -> grpc.ChannelCredentials:
    """Client credentials trusting ``tls.ca`` and presenting ``tls.cert``/``tls.key`` if set."""
    if isinstance(tls, ClientTls):
        return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                            certificate_chain=tls.cert)
    if (tls.cert is None) != (tls.key is None):
        raise AuthConfigError("a TLS client certificate needs its key and the other way round "
                              f"(got cert={tls.cert!r}, key={tls.key!r})")
    ca = _read_pem(tls.ca, "server CA certificate")
    chain = _read_pem(tls.cert, "client certificate") if tls.cert is not None else None
    key = _read_pem(tls.key, "client private key") if tls.key is not None else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=chain)


def channel_options(tls: TlsFiles | ClientTls | None) -> list[tuple[str, object]]:
    """Channel options that go with ``tls`` (the server-name override, if any)."""
    if tls is not None and tls.server_name:
        return [("grpc.ssl_target_name_override", tls.server_name)]
    return []


# ----------------------------------------------------------------------------------------------
# Mutual TLS from a directory that rotates (a mounted Secret), and the caller's name

TLS_CERT, TLS_KEY, TLS_CLIENT_CA = "tls.crt", "tls.key", "client-ca.crt"
DEFAULT_CLIENT_NAME = "dynatrain-operator"


def _check_pair(chain: bytes, key: bytes, where: str) -> None:
    """Raise :class:`AuthConfigError` unless ``key`` is the private key of ``chain``'s first
    certificate. Files rewritten one at a time pass through states where they do not match;
    serving such a pair would fail every handshake, so it is refused like a failed read."""
    try:
        cert = x509.load_pem_x509_certificate(chain)
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as e:
        raise AuthConfigError(f"the TLS files in {where} cannot be loaded: {e}") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != private.public_key().public_bytes(*fmt):
        raise AuthConfigError(f"{TLS_KEY} in {where} is not the key of {TLS_CERT}")


class ServerTlsDir:
    """Server-side mutual TLS from ``DIR/tls.crt``, ``DIR/tls.key`` and ``DIR/client-ca.crt``,
    re-read when they change on disk.

    The files must be usable when this object is made (:class:`AuthConfigError` otherwise,
    naming the file). :meth:`credentials` gives gRPC dynamic credentials whose fetcher runs at
    every new handshake: one ``stat`` per file, and a read only when a file's modification
    time, size or inode changed (a Kubernetes Secret update swaps a symlink). If the new files
    cannot be read, or the key does not match the certificate (files copied one by one), the
    last good configuration stays in force, a warning is logged once per change, and the
    next handshake tries again. Connections already open keep the certificate they were made
    with; a client that needs the new one opens a new connection.

    **Cost under load.** The fetcher is Python and gRPC calls it, holding the GIL, before every
    new connection's handshake (grpcio's ``_server_cert_config_fetcher_wrapper`` is ``with
    gil``; the core calls it from ``add_handshakers``). In a training process busy in Python
    a handshake therefore waits for the GIL, once to enter and once after each ``stat``
    (which releases it): on 2 cores with four busy Python threads in the agent's process,
    median 26 ms and worst 145 ms of 40, against 4 and 11 ms with static credentials; with
    the cores also shared by other processes, tails near 1 s. It stays because gRPC Python has no
    other way to change a listening server's certificate (no file-watcher certificate
    provider; a port cannot be rebound without closing it, and a closed port reads as an
    exited worker), and a rotation must reach the very next connection. What this asks of
    clients: give a connection attempt seconds, not the 0.1 s that
    ``grpc.min_reconnect_backoff_ms=100`` sets (gRPC uses that argument as the minimum
    connect timeout, covering the TLS handshake; grpc/grpc#12830, #33423). Connections are
    long-lived, so the cost is paid per client, not per call
    (``tests/agent/test_tls_under_load.py``, issue #32).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise AuthConfigError(f"the TLS directory {str(directory)!r} does not exist or is "
                                  f"not a directory; it must hold {TLS_CERT}, {TLS_KEY} and "
                                  f"{TLS_CLIENT_CA}")
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._failed_signature = None
        self.config = self._read()        # raises if unusable
        self.reloads = 0
        """How many times new files were taken into use (for logs and tests)."""

    def _paths(self) -> tuple[Path, Path, Path]:
        return (self.directory / TLS_CERT, self.directory / TLS_KEY,
                self.directory / TLS_CLIENT_CA)

    def _stat(self) -> tuple:
        out = []
        for path in self._paths():
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
            else:
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _read(self) -> grpc.ServerCertificateConfiguration:
        cert_path, key_path, ca_path = self._paths()
        chain = _read_pem(cert_path, "server certificate")
        key = _read_pem(key_path, "server private key")
        ca = _read_pem(ca_path, "client CA certificate")
        _check_pair(chain, key, str(self.directory))
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate fetcher: a new configuration when the files changed, else None
        (keep the current one). Never raises: gRPC runs it inside a handshake."""
        signature = self._stat()
        if signature == self._signature:
            return None
        with self._lock:
            if signature == self._signature:
                return None
            try:
                config = self._read()
            except AuthConfigError as e:
                if signature != self._failed_signature:
                    log.warning("%s; keeping the previous TLS certificate", e)
                    self._failed_signature = signature
                return None
            except Exception as e:      # never let a handshake die in here
                log.warning("re-reading the TLS files in %s failed (%s: %s); keeping the "
                            "previous TLS certificate", self.directory, type(e).__name__, e)
                return None
            self._signature, self._failed_signature = signature, None
            self.config = config
            self.reloads += 1
            log.info("re-read the TLS files in %s after they changed", self.directory)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.config, self.fetch,
                                                   require_client_authentication=True)


def _as_text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def client_names(auth_context: dict) -> list[str]:
    """The names a caller's certificate carries (subject CN, then subject alternative
    names), from gRPC's ``context.auth_context()``; empty without a client certificate."""
    names = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in (auth_context or {}).get(key, ()):
            name = _as_text(value)
            if name not in names:
                names.append(name)
    return names


def client_name_problem(auth_context: dict, expected: str) -> str | None:
    """Why a caller with ``auth_context`` is not ``expected`` (None if it is): its client
    certificate must carry ``expected`` as its subject CN or a subject alternative name."""
    names = client_names(auth_context)
    if expected in names:
        return None
    security = ",".join(_as_text(v) for v in (auth_context or {})
                        .get("transport_security_type", ())) or "none"
    if not names:
        return (f"the caller presented no client certificate names (transport security: "
                f"{security}); expected a certificate for {expected!r}")
    shown = ", ".join(repr(n[:100]) for n in names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return (f"the caller's certificate names {shown}{more}, not {expected!r}: only "
            f"{expected!r} may call this agent (--tls-client-name)")
