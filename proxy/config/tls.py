"""TLS on the listeners and on the connections to backends: the config models, and the SSL
contexts and gRPC credentials made from them.

What it guards against: a certificate or key that cannot be read, is not PEM, or does not go
with its key found at the first handshake (or never, on a quiet port); here it is a config error
at load and in ``mmguard check-config``, naming the file. And a certificate renewed on disk
(cert-manager rewriting a mounted Secret) that a running proxy keeps ignoring until restarted.

What MUST hold:
- Every file is read and parsed when the config is validated; a model carries a digest of the
  files' bytes, so two configs with the same paths but different certificates are not equal
  (a reload rebuilds the backends whose certificates changed, and reloads listener certificates).
- A listener's certificate, key and client CA bundle are swapped in by ``ListenerTls.update``;
  connections made after it see the new ones, open connections keep theirs. Whether TLS is on,
  whether client certificates are required and the minimum version are fixed at start.
"""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
from pathlib import Path
from typing import Any, Literal

import grpc
from pydantic import PrivateAttr, field_validator, model_validator

from proxy.config.refs import skipped_offline
from proxy.files import PEM_BYTES, read_bounded
from proxy.strict import Strict

log = logging.getLogger("mmguard.tls")

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
_PEM_BEGIN = {"CERTIFICATE": re.compile(rb"-----BEGIN CERTIFICATE-----"),
              "PRIVATE KEY": re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----")}


class TlsServer(Strict):
    """TLS on a listener (``listeners.<name>.tls``)."""

    cert_file: Path
    """PEM certificate chain the listener presents, leaf first."""
    key_file: Path
    """PEM private key of that certificate (not encrypted)."""
    client_ca_file: Path | None = None
    """PEM CA bundle. Set: mutual TLS, clients must present a certificate signed by one of these."""
    min_version: Literal["1.2", "1.3"] = "1.2"
    """Lowest TLS version accepted (HTTP and admin listeners; gRPC's floor is fixed at 1.2)."""
    _digest: str = PrivateAttr("")

    @field_validator("cert_file", "client_ca_file")
    @classmethod
    def _certificates(cls, path: Path | None) -> Path | None:
        if path is not None:
            _pem(path, "CERTIFICATE")
        return path

    @field_validator("key_file")
    @classmethod
    def _key(cls, path: Path) -> Path:
        _pem(path, "PRIVATE KEY")
        return path

    @model_validator(mode="after")
    def _usable(self) -> TlsServer:
        if skipped_offline(f"TLS file {self.cert_file}"):
            return self
        try:
            server_context(self)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(_unusable(self.cert_file, self.key_file, self.client_ca_file,
                                       exc)) from None
        self._digest = _digest(self.cert_file, self.key_file, self.client_ca_file)
        return self

    @property
    def digest(self) -> str:
        """sha256 over the files' bytes as read at validation."""
        return self._digest


class TlsClient(Strict):
    """TLS to a backend (``backends[i].tls``)."""

    ca_file: Path | None = None
    """PEM CA bundle the backend's certificate must chain to; the system's trust store if absent."""
    cert_file: Path | None = None
    """PEM client certificate, for backends that require mutual TLS (with ``key_file``)."""
    key_file: Path | None = None
    server_name: str | None = None
    """Name sent as SNI and checked against the backend's certificate, instead of the URL's host."""
    insecure_skip_verify: bool = False
    """Accept any certificate from the backend. For tests only: it is logged as a warning, and
    refused for triton_grpc backends (grpcio cannot turn verification off)."""
    _digest: str = PrivateAttr("")

    @field_validator("cert_file", "ca_file")
    @classmethod
    def _certificates(cls, path: Path | None) -> Path | None:
        if path is not None:
            _pem(path, "CERTIFICATE")
        return path

    @field_validator("key_file")
    @classmethod
    def _key(cls, path: Path | None) -> Path | None:
        if path is not None:
            _pem(path, "PRIVATE KEY")
        return path

    @model_validator(mode="after")
    def _usable(self) -> TlsClient:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (the client certificate and "
                             "its key); set both or neither")
        if any(p is not None and skipped_offline(f"TLS file {p}")
               for p in (self.ca_file, self.cert_file, self.key_file)):
            return self
        try:
            client_context(self)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(_unusable(self.cert_file, self.key_file, self.ca_file,
                                       exc)) from None
        self._digest = _digest(self.ca_file, self.cert_file, self.key_file)
        return self

    @property
    def digest(self) -> str:
        return self._digest


def _pem(path: Path, kind: Literal["CERTIFICATE", "PRIVATE KEY"]) -> bytes:
    if skipped_offline(f"TLS file {path}"):
        return b""
    data = read_bounded(path, PEM_BYTES)  # ValueError: not a regular file, too big, unreadable
    if not _PEM_BEGIN[kind].search(data):
        raise ValueError(f"{path} is not a PEM {kind.lower()} (no '-----BEGIN ...{kind}-----' "
                         f"block)")
    if kind == "PRIVATE KEY" and b"ENCRYPTED" in data:
        raise ValueError(f"{path} is an encrypted private key; mmguard takes unencrypted keys "
                         f"(protect the file instead)")
    return data


def _read(path: Path) -> bytes:
    """A TLS file, bounded (``PEM_BYTES``, a regular file): an ``OSError`` naming why not, as
    the SSL loaders raise, so a file that changed since validation fails as they would."""
    try:
        return read_bounded(path, PEM_BYTES)
    except ValueError as exc:
        raise OSError(str(exc)) from None


def _unusable(cert: Path | None, key: Path | None, ca: Path | None, exc: Exception) -> str:
    files = ", ".join(str(p) for p in (cert, key, ca) if p is not None)
    return f"the TLS files do not load together ({files}): {exc}"


def _digest(*paths: Path | None) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(b"\0" if path is None else hashlib.sha256(_read(path)).digest())
    return h.hexdigest()


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key.
    raise ValueError("the private key is encrypted")


# --- listeners ------------------------------------------------------------------------------


def server_context(tls: TlsServer) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[tls.min_version]
    ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    if tls.client_ca_file is not None:
        ctx.load_verify_locations(cafile=tls.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _grpc_certificates(tls: TlsServer) -> Any:
    root = _read(tls.client_ca_file) if tls.client_ca_file is not None else None
    return grpc.ssl_server_certificate_configuration(
        [(_read(tls.key_file), _read(tls.cert_file))], root_certificates=root)


def restart_needed(old: TlsServer | None, new: TlsServer | None) -> str | None:
    """Why a change from ``old`` to ``new`` cannot be applied to a running listener, if so."""
    if (old is None) != (new is None):
        return "turning TLS on or off"
    if old is None or new is None:
        return None
    if (old.client_ca_file is None) != (new.client_ca_file is None):
        return "turning client certificates (mutual TLS) on or off"
    if old.min_version != new.min_version:
        return "a new min_version"
    return None


class ListenerTls:
    """One listener's TLS, whose certificates can be replaced while it serves.

    aiohttp listeners get ``ssl_context``, a ``RotatingContext``: every accepted connection is
    wrapped by the newest ``server_context``, so it has that context's own session cache and
    session-ticket keys (OpenSSL draws fresh ticket keys per context). A session or ticket
    issued under the old certificate or client CA therefore cannot be resumed after an update:
    the client makes a full handshake, verified against the new CA (a client that resumed its
    CA1 session still got 200 when the SNI hook swapped only the certificate context, since
    OpenSSL looks sessions up in the listening context). The gRPC listener gets dynamic
    credentials: gRPC asks ``_fetch`` before each handshake, and it answers the new
    certificates once after an update (gRPC then builds a new ``SSL_CTX``, with new keys).
    """

    def __init__(self, tls: TlsServer) -> None:
        self.config = tls
        self.ssl_context = RotatingContext(ssl.PROTOCOL_TLS_SERVER)
        self.ssl_context.current = server_context(tls)
        self._pending: Any = None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _grpc_certificates(self.config), self._fetch,
            require_client_authentication=self.config.client_ca_file is not None)

    def _fetch(self) -> Any:
        pending, self._pending = self._pending, None
        return pending

    def update(self, tls: TlsServer) -> None:
        """Serve ``tls``'s files to new connections (``restart_needed`` must have said None);
        sessions of the old context are not resumed."""
        current, pending = server_context(tls), _grpc_certificates(tls)
        self.ssl_context.current, self._pending, self.config = current, pending, tls


class RotatingContext(ssl.SSLContext):
    """The context a listener is started with, standing for ``current``: asyncio wraps each
    accepted connection with ``wrap_bio``, which hands it to ``current`` whole (certificate,
    client CA, session cache and ticket keys together)."""

    current: ssl.SSLContext

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 server_side: bool = False, server_hostname: str | bytes | None = None,
                 session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        return self.current.wrap_bio(incoming, outgoing, server_side, server_hostname, session)


# --- backends -------------------------------------------------------------------------------


class _NamedContext(ssl.SSLContext):
    """Sends ``server_name`` as SNI and checks the certificate against it, whatever host the
    connection was opened to (aiohttp passes the URL's host)."""

    server_name = ""

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,
                 server_side: bool = False, server_hostname: str | bytes | None = None,
                 session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        return super().wrap_bio(incoming, outgoing, server_side, self.server_name, session)


def client_context(tls: TlsClient) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.server_name is not None:
        named = _NamedContext(ssl.PROTOCOL_TLS_CLIENT)
        named.server_name = tls.server_name
        ctx = named
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.ca_file is not None:
        ctx.load_verify_locations(cafile=tls.ca_file)
    else:
        ctx.load_default_certs()
    if tls.cert_file is not None and tls.key_file is not None:
        ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    if tls.insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def backend_ssl_context(tls: TlsClient, backend: str) -> ssl.SSLContext:
    if tls.insecure_skip_verify:
        log.warning("backend %r: TLS certificate verification is off (insecure_skip_verify); "
                    "anyone on the path can impersonate this backend. For tests only.", backend)
    return client_context(tls)


def grpc_channel_credentials(tls: TlsClient) -> tuple[grpc.ChannelCredentials,
                                                       list[tuple[str, Any]]]:
    """Credentials and the channel options that go with them (the target name override)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file) if tls.ca_file is not None else None,
        private_key=_read(tls.key_file) if tls.key_file is not None else None,
        certificate_chain=_read(tls.cert_file) if tls.cert_file is not None else None)
    options: list[tuple[str, Any]] = []
    if tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return creds, options
