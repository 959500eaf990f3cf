"""The listeners' config models (``listeners:`` in the config file): the KServe v2 / OpenAI HTTP
front, the gRPC front and the admin port, with their limits and TLS."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import Field, PrivateAttr, SecretStr, model_validator

from proxy.config.refs import read_secret
from proxy.config.tls import TlsServer
from proxy.strict import Strict

MiB = 1024 * 1024


class ClientTrust(Strict):
    """What a data listener trusts its clients with: the canary headers they send, and the
    headers that tell them their treatment."""

    trust_canary_headers: bool = False
    """Keep the canary headers (``canary.headers``) that clients send; stripped otherwise."""
    treatment_headers: bool | None = None
    """Send this listener's clients the headers / trailers that reveal a call's treatment
    (``mmguard-shadow``, ``mmguard-fault``, an injected fault's tag in its message). None (the
    default) follows ``trust_canary_headers``: a trusted mesh sees its treatment, an untrusted
    client never learns whether it was mirrored or faulted (docs/security.md)."""

    client_header: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$", max_length=64)
    """A header that says who the client is, set on every request by a gateway in front of this
    listener that overwrites whatever the client sent (an authenticated user or service id,
    Envoy's ``x-forwarded-client-cert``); lower-case. With it, mmguard links each client's
    unary requests for the filters that compare a client's requests (``quality``'s residue:
    the page a client sent before). mmguard cannot check the header: name it only behind such
    a gateway, since a client that can set it can probe whether another client's recent
    images look like one of its own. Absent (the default): no unary request is linked to
    another (a gRPC stream is one client's and is linked within itself either way)."""

    @property
    def shows_treatment(self) -> bool:
        return (self.trust_canary_headers if self.treatment_headers is None
                else self.treatment_headers)


class HttpListener(ClientTrust):
    host: str = "0.0.0.0"
    """Address the KServe v2 HTTP front binds."""
    port: int = Field(9000, ge=0, le=65535)
    """0 picks a free port (logged at start)."""
    max_request_bytes: int = Field(64 * MiB, gt=0)
    """Bodies above this are refused with 413 before they are read; a compressed body is
    refused as soon as it inflates past it (it is never held whole)."""
    max_json_bytes: int = Field(16 * MiB, gt=0)
    """Pure-JSON request bodies (no binary tensor part), the JSON header of binary ones, and
    OpenAI request bodies (and what they become with fetched images inlined), above this get
    413. A quarter of ``max_request_bytes`` on purpose: a JSON tensor costs
    about ten times its size in memory to parse (57 MiB of JSON held +700 MB), and parsing it
    (and writing a JSON answer) holds the interpreter lock, worker thread or not, so one big
    JSON body stalls every other request on the listener (about 0.15 s per MiB on two busy
    cores). 16 MiB still takes two 224x224 RGB images as JSON (5.8 MB each, as tritonclient
    writes them). Binary tensors cost neither, and tritonclient sends inputs binary by
    default; raise this only for clients that cannot, knowing the stall grows with it."""
    tls: TlsServer | None = None
    """TLS (and mutual TLS with ``client_ca_file``); plain HTTP when absent."""
    max_header_bytes: int = Field(16 * 1024, gt=0)
    """The request line, each header line, and all headers together; above it aiohttp answers
    400 (one line too long) or mmguard 431 (the total)."""
    max_concurrent_requests: int | None = Field(None, gt=0)
    """Requests served at once on this listener (health probes aside); the next ones get 429
    with Retry-After. Unlimited when absent."""
    max_connections: int | None = Field(None, gt=0)
    """Open client connections at once. At the cap a new connection replaces the oldest one
    that has no request in progress (idle, or still sending its headers); when every one has,
    the new one gets 503 and is closed. Each refusal or eviction is counted. Absent: derived
    from the process's open-files limit (``RLIMIT_NOFILE``, raised to the hard limit at start),
    at most 1000 (docs/security.md, "Budgets")."""
    backlog: int | None = Field(None, gt=0)
    """Connections the kernel queues for accept (``listen(2)``'s backlog). Absent: the
    kernel's ``net.core.somaxconn`` (the most it allows), as Envoy and gRPC core do; a burst
    past a full queue has its connection attempts dropped, and each client's retry waits 1 s."""
    header_timeout_s: float = Field(10.0, gt=0)
    """From a connection's start, or its previous answer, until the next request's headers are
    complete; a connection idle that long is closed (so also the keep-alive idle time). A TLS
    handshake has as long."""
    body_timeout_s: float = Field(120.0, gt=0)
    """From the headers until the whole body is in; slower: 408 and the connection closed."""
    min_body_bytes_per_s: int = Field(1024, ge=0)
    """Bodies that arrive slower than this (measured from 5 s after the headers) get 408 and
    the connection closed, however long ``body_timeout_s`` is. 0: no minimum rate."""
    fast_lane: bool = True
    """KServe v2 infer requests (``POST /v2/models/<m>[/versions/<v>]/infer``) and OpenAI
    inference requests (``POST /v1/chat/completions`` and the other endpoints through the
    chain), over HTTP/1.1,
    are served on a bare asyncio protocol with llhttp's parser instead of aiohttp's server:
    the same checks and answers, less CPU per request. Any other request, and any infer
    request it does not take whole (chunked, HTTP/1.0, an upgrade, a head the parser refuses,
    a refused body), goes to aiohttp on the same connection. false: aiohttp serves all."""


class GrpcListener(ClientTrust):
    host: str = "0.0.0.0"
    port: int = Field(9001, ge=0, le=65535)
    max_request_bytes: int = Field(64 * MiB, gt=0)
    """Messages above this are refused by gRPC with RESOURCE_EXHAUSTED."""
    max_stream_bytes: int | None = Field(None, gt=0)
    """What one ``ModelStreamInfer`` stream may hold: its requests in flight and the answers
    its client has not taken yet. Past it the stream reads no more requests until some are
    answered (HTTP/2 flow control holds the client back); one request always runs. Absent:
    ``max_request_bytes``, what one unary call holds."""
    max_streams_bytes: int = Field(256 * MiB, gt=0)
    """The same, for every stream of the listener together. A request that would pass it, on
    a stream that holds nothing yet, is refused in the stream (RESOURCE_EXHAUSTED's words,
    the stream stays open); a stream that holds something waits for its own answers."""
    tls: TlsServer | None = None
    """TLS (and mutual TLS with ``client_ca_file``); plaintext HTTP/2 when absent."""
    max_header_bytes: int = Field(16 * 1024, gt=0)
    """Request metadata (headers) in all; above it gRPC refuses the call with
    RESOURCE_EXHAUSTED."""
    max_concurrent_streams: int = Field(256, gt=0)
    """Calls at once on one client connection (HTTP/2 SETTINGS). Calls past it are refused
    with RST_STREAM REFUSED_STREAM, which the client sees as UNAVAILABLE "Stream removed":
    gRPC clients do not reliably queue at the server's limit (grpcio 1.85 lets about half of a
    burst through and has the rest refused, on a new connection or an old one). Size it above
    what one client connection runs at once; ``max_concurrent_requests`` is the listener-wide
    cap with a clear RESOURCE_EXHAUSTED. (gRPC's own default is unbounded.)"""
    max_concurrent_requests: int | None = Field(None, gt=0)
    """Calls at once on the whole listener, health checks included; the next ones get
    RESOURCE_EXHAUSTED. Unlimited when absent."""
    max_connections: int | None = Field(None, gt=0)
    """Open client connections at once (gRPC refuses more before their handshake; gRPC does not
    count them, so they are not in ``mmguard_listener_refusals_total``). Absent: derived from
    ``RLIMIT_NOFILE`` as for the HTTP listener, at most 1000."""
    handshake_timeout_s: float = Field(10.0, gt=0)
    """A new connection's TLS and HTTP/2 handshake must be done within this: the client's
    preface and SETTINGS, and its acknowledgement of ours (``grpc.http2.settings_timeout``);
    otherwise the connection is closed. A connection done with its handshake that sends no
    call is closed after ``max_connection_idle_s``."""
    max_connection_idle_s: float = Field(300.0, gt=0)
    """A connection with no call for this long is closed (GOAWAY)."""

    @model_validator(mode="after")
    def _tls_version(self) -> GrpcListener:
        if self.tls is not None and self.tls.min_version != "1.2":
            raise ValueError("tls.min_version: grpcio cannot set a minimum TLS version; the gRPC "
                             "listener always accepts TLS 1.2 and 1.3, so only '1.2' is allowed")
        return self


class AdminListener(Strict):
    host: str = "127.0.0.1"
    """Localhost by default: the admin port is not for the world."""
    port: int = Field(9002, ge=0, le=65535)
    token: SecretStr | None = None
    """When set, requests that change state need ``Authorization: Bearer <token>``. Never shown
    in logs or ``repr``; prefer ``token_file`` or ``token_env`` to keep it out of the file."""
    token_file: Path | None = None
    """The token from a file (a mounted Kubernetes Secret); surrounding whitespace is dropped."""
    token_env: str | None = None
    """The token from this environment variable."""
    tls: TlsServer | None = None
    """TLS (and mutual TLS with ``client_ca_file``) on the admin API."""
    max_request_bytes: int = Field(1 * MiB, gt=0, le=1 * MiB)
    """Bodies above this are refused with 413; bodies must declare Content-Length (411
    otherwise). At most 1 MiB, aiohttp's own cap on the admin app."""
    max_header_bytes: int = Field(8 * 1024, gt=0)
    """As for the HTTP listener."""
    max_connections: int | None = Field(None, gt=0)
    """As for the HTTP listener (Prometheus, probes and an operator need few): at most 64."""
    backlog: int | None = Field(None, gt=0)
    """As for the HTTP listener."""
    header_timeout_s: float = Field(10.0, gt=0)
    """As for the HTTP listener."""
    body_timeout_s: float = Field(30.0, gt=0)
    """As for the HTTP listener."""
    min_body_bytes_per_s: int = Field(1024, ge=0)
    """As for the HTTP listener."""
    _token_digest: str = PrivateAttr("")

    @model_validator(mode="after")
    def _one_token(self) -> AdminListener:
        sources = [k for k in ("token", "token_file", "token_env") if getattr(self, k) is not None]
        if len(sources) > 1:
            raise ValueError(f"the admin token comes from one source; {' and '.join(sources)} "
                             f"are both set")
        token = self.resolve_token()
        if token is not None:
            self._token_digest = hashlib.sha256(token.encode()).hexdigest()
        return self

    def resolve_token(self) -> str | None:
        """The token from whichever source is set (read now); ValueError if that source is
        missing or empty. The message never contains the token."""
        return read_secret("token", self.token, self.token_file, self.token_env,
                           "an empty admin token would let anyone act")


class Listeners(Strict):
    http: HttpListener = HttpListener()
    grpc: GrpcListener = GrpcListener()
    admin: AdminListener = AdminListener()
