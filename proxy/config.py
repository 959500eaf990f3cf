"""mmguard's configuration: one YAML file validated into frozen, typed models.

Unknown keys are refused everywhere (``extra="forbid"``). Errors name the key path and the reason,
e.g. ``models[0].filters[1].limits.max_batch: Input should be greater than 0``. Each filter's own
config model lives beside the filter and is found through its factory; ``load_config`` validates
those too, so ``mmguard check-config`` catches a bad filter option before anything serves.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    model_validator,
)

from proxy.chain import filter_factories
from proxy.config_refs import (
    ConfigReferences,
    model_dir_problems,
    read_secret,
    reference_problems,
    unreadable_value,
)
from proxy.tls import TlsClient, TlsServer

MiB = 1024 * 1024


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HttpListener(Strict):
    host: str = "0.0.0.0"
    """Address the KServe v2 HTTP front binds."""
    port: int = Field(9000, ge=0, le=65535)
    """0 picks a free port (logged at start)."""
    max_request_bytes: int = Field(64 * MiB, gt=0)
    """Bodies above this are refused with 413 before they are read; a compressed body is
    refused as soon as it inflates past it (it is never held whole)."""
    max_json_bytes: int = Field(16 * MiB, gt=0)
    """Pure-JSON request bodies (no binary tensor part), and the JSON header of binary ones,
    above this get 413. A quarter of ``max_request_bytes`` on purpose: a JSON tensor costs
    about ten times its size in memory to parse (57 MiB of JSON held +700 MB), and parsing it
    (and writing a JSON answer) holds the interpreter lock, worker thread or not, so one big
    JSON body stalls every other request on the listener (about 0.15 s per MiB on two busy
    cores). 16 MiB still takes two 224x224 RGB images as JSON (5.8 MB each, as tritonclient
    writes them). Binary tensors cost neither, and tritonclient sends inputs binary by
    default; raise this only for clients that cannot, knowing the stall grows with it."""
    trust_canary_headers: bool = False
    """Keep the canary headers (``canary.headers``) that clients send; stripped otherwise."""
    tls: TlsServer | None = None
    """TLS (and mutual TLS with ``client_ca_file``); plain HTTP when absent."""
    max_header_bytes: int = Field(16 * 1024, gt=0)
    """The request line, each header line, and all headers together; above it aiohttp answers
    400 (one line too long) or mmguard 431 (the total)."""
    max_concurrent_requests: int | None = Field(None, gt=0)
    """Requests served at once on this listener (health probes aside); the next ones get 429
    with Retry-After. Unlimited when absent."""
    max_connections: int = Field(1000, gt=0)
    """Open client connections at once. At the cap a new connection replaces the oldest one
    that has no request in progress (idle, or still sending its headers); when every one has,
    the new one gets 503 and is closed. Each refusal or eviction is counted."""
    header_timeout_s: float = Field(10.0, gt=0)
    """From a connection's start, or its previous answer, until the next request's headers are
    complete; a connection idle that long is closed (so also the keep-alive idle time). A TLS
    handshake has as long."""
    body_timeout_s: float = Field(120.0, gt=0)
    """From the headers until the whole body is in; slower: 408 and the connection closed."""
    min_body_bytes_per_s: int = Field(1024, ge=0)
    """Bodies that arrive slower than this (measured from 5 s after the headers) get 408 and
    the connection closed, however long ``body_timeout_s`` is. 0: no minimum rate."""


class GrpcListener(Strict):
    host: str = "0.0.0.0"
    port: int = Field(9001, ge=0, le=65535)
    max_request_bytes: int = Field(64 * MiB, gt=0)
    """Messages above this are refused by gRPC with RESOURCE_EXHAUSTED."""
    trust_canary_headers: bool = False
    """Keep the canary headers (``canary.headers``) that clients send; stripped otherwise."""
    tls: TlsServer | None = None
    """TLS (and mutual TLS with ``client_ca_file``); plaintext HTTP/2 when absent."""
    max_header_bytes: int = Field(16 * 1024, gt=0)
    """Request metadata (headers) in all; above it gRPC refuses the call with
    RESOURCE_EXHAUSTED."""
    max_concurrent_streams: int = Field(256, gt=0)
    """Calls at once on one client connection (HTTP/2 SETTINGS); the client queues the rest.
    (gRPC's own default is unbounded.)"""
    max_concurrent_requests: int | None = Field(None, gt=0)
    """Calls at once on the whole listener, health checks included; the next ones get
    RESOURCE_EXHAUSTED. Unlimited when absent."""
    max_connections: int = Field(1000, gt=0)
    """Open client connections at once (gRPC refuses more before their handshake; gRPC does not
    count them, so they are not in ``mmguard_listener_refusals_total``)."""
    handshake_timeout_s: float = Field(10.0, gt=0)
    """A new connection's TLS and HTTP/2 handshake must be done within this."""
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
    max_connections: int = Field(64, gt=0)
    """As for the HTTP listener (Prometheus, probes and an operator need few)."""
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


class SharedMemoryHandoff(Strict):
    """Slots mmguard registers with a co-located Triton (``shared_memory: system``)."""

    slots: int = Field(16, ge=1, le=1024)
    """Calls that can be in a slot at once; a call that finds none free goes inline."""
    max_slot_bytes: int = Field(64 * MiB, gt=0)
    """A slot is sized from the live contracts (largest fixed-size request + answer), up to
    this; a call that does not fit goes inline."""


def _check_colocated(url: str, shared_memory: str) -> None:
    if shared_memory == "off":
        return
    host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host not in ("localhost", "127.0.0.1", "::1"):
        raise ValueError(f"shared_memory: {shared_memory} needs Triton beside mmguard (a "
                         f"loopback url, sharing /dev/shm), not {url!r}")


class TritonGrpcBackend(Strict):
    kind: Literal["triton_grpc"]
    name: str
    url: str
    """host:port of Triton's gRPC endpoint."""
    timeout_s: float = Field(30.0, gt=0)
    channels: int = Field(1, ge=1, le=64)
    """gRPC channels (HTTP/2 connections) used round-robin."""
    max_message_bytes: int = Field(256 * MiB, gt=0)
    tls: TlsClient | None = None
    """TLS to Triton (mutual with ``cert_file``/``key_file``); plaintext when absent."""
    shared_memory: Literal["off", "system"] = "off"
    """``system``: input tensors (and outputs of known size) cross to Triton in mmguard's own
    /dev/shm regions instead of the message (docs/shared-memory.md)."""
    shared_memory_pool: SharedMemoryHandoff = SharedMemoryHandoff()

    @model_validator(mode="after")
    def _verify(self) -> TritonGrpcBackend:
        _check_colocated(self.url, self.shared_memory)
        if self.tls is not None and self.tls.insecure_skip_verify:
            raise ValueError("tls.insecure_skip_verify is not available for triton_grpc "
                             "(grpcio always verifies); give tls.ca_file instead")
        return self


class TritonHttpBackend(Strict):
    kind: Literal["triton_http"]
    name: str
    url: str
    """http://host:port (or host:port) of Triton's HTTP endpoint."""
    timeout_s: float = Field(30.0, gt=0)
    pool_size: int = Field(64, ge=1)
    """Keep-alive connections kept open to the server."""
    tls: TlsClient | None = None
    """TLS to Triton; an ``https://`` url without it uses the system's trust store."""
    shared_memory: Literal["off", "system"] = "off"
    """``system``: input tensors (and outputs of known size) cross to Triton in mmguard's own
    /dev/shm regions instead of the body (docs/shared-memory.md)."""
    shared_memory_pool: SharedMemoryHandoff = SharedMemoryHandoff()

    @model_validator(mode="after")
    def _scheme(self) -> TritonHttpBackend:
        _check_scheme(self.url, self.tls)
        _check_colocated(self.url, self.shared_memory)
        return self


class OnnxRuntimeBackend(Strict):
    kind: Literal["onnxruntime"]
    name: str
    model_dir: Path
    """A repository laid out like Triton's: <model>/<version>/model.onnx (or <model>.onnx)."""
    models: tuple[str, ...] | None = None
    """Models to load; all found in model_dir when absent."""
    threads: int = Field(2, ge=1, le=256)
    """Worker threads running inference (the bounded pool)."""
    intra_op_threads: int = Field(1, ge=0)
    """ONNX Runtime's own threads per run; 0 lets it decide."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when onnxruntime-gpu is installed and CUDA really loads, else CPU."""
    max_batch_size: dict[str, int] = {}
    """Per model: declare the leading dim a batch dim of at most this size (Triton's meaning)."""
    timeout_s: float = Field(30.0, gt=0)


class VllmBackend(Strict):
    kind: Literal["vllm"]
    name: str
    url: str
    """http://host:port of vLLM's OpenAI-compatible server."""
    timeout_s: float = Field(60.0, gt=0)
    """Until the answer starts (for streams) or ends (otherwise)."""
    pool_size: int = Field(100, ge=1)
    image_input: Literal["auto", "yes", "no"] = "auto"
    """Whether the model takes images; auto probes once with a one-token request."""
    tls: TlsClient | None = None
    """TLS to vLLM; an ``https://`` url without it uses the system's trust store."""

    @model_validator(mode="after")
    def _scheme(self) -> VllmBackend:
        _check_scheme(self.url, self.tls)
        return self


def _check_scheme(url: str, tls: TlsClient | None) -> None:
    if tls is not None and url.lower().startswith("http://"):
        raise ValueError(f"url '{url}' is plain http:// but tls is set; write https:// "
                         f"(or host:port)")


BackendConfig = Annotated[TritonGrpcBackend | TritonHttpBackend | OnnxRuntimeBackend | VllmBackend,
                          Field(discriminator="kind")]


class RemoteImageFetch(Strict):
    """Limits of mmguard's own fetch of an allow-listed image (``remote_images: fetch``)."""

    max_bytes: int = Field(8 << 20, gt=0)
    """The most bytes one image may have (counted as it arrives, past any compression)."""
    timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    """The whole fetch of one image, redirects included."""
    max_redirects: int = Field(3, ge=0, le=10)
    """Redirects followed; each target must itself be allow-listed."""
    max_images: int = Field(8, ge=1)
    """Remote images one request may name (each is a fetch mmguard makes for the client)."""
    content_types: tuple[str, ...] = ("image/png", "image/jpeg", "image/webp", "image/gif",
                                      "image/bmp")
    """Content-Types accepted from the image host (anything else is refused, SVG included)."""
    allow_networks: tuple[str, ...] = ()
    """CIDRs a host *name* may resolve into besides globally routable addresses (an allow-listed
    IP literal is always allowed). Checked after DNS, on the address connected to."""

    @model_validator(mode="after")
    def _networks(self) -> RemoteImageFetch:
        import ipaddress
        for net in self.allow_networks:
            ipaddress.ip_network(net, strict=False)  # ValueError names the bad entry
        return self


class OpenAIConfig(Strict):
    image_url_allow_hosts: tuple[str, ...] = ()
    """``host`` or ``host:port`` (``[::1]:port``) whose http(s) media URLs are allowed; a bare host
    means the scheme's default port. Everything else must be inline ``data:`` URLs."""
    remote_images: Literal["fetch", "forward"] = "fetch"
    """``fetch``: mmguard fetches allow-listed images itself (``fetch`` limits, redirects and
    resolved addresses checked) and sends them inline; remote audio/video URLs are refused.
    ``forward``: the checked URL goes to the backend, which fetches it (see docs/openai.md for
    the vLLM flags that must then close redirects and other hosts)."""
    fetch: RemoteImageFetch = RemoteImageFetch()

    @model_validator(mode="after")
    def _hosts(self) -> OpenAIConfig:
        from proxy.media_urls import parse_allow_entry
        for entry in self.image_url_allow_hosts:
            parse_allow_entry(entry)  # ValueError names the entry and what is wrong
        return self


class CanaryConfig(Strict):
    """Which calls are canary traffic: the only calls that fault experiments may touch."""

    headers: dict[str, str] = {}
    """Header → value that marks a call as canary (all must match; ``"*"`` matches any value).
    Clients' copies are stripped unless the listener has ``trust_canary_headers``."""
    share: float = Field(0.0, ge=0.0, le=1.0)
    """A share of all traffic chosen stably by ``key``: the same key is always in or out."""
    key: str = "x-request-id"
    """Header whose value picks the share; the request id when absent; random when neither. The
    shadow filter's percent and the fault experiments' shares are chosen on the same key."""
    secret_file: Path | None = None
    """The secret that keys share membership (HMAC-SHA256), from a file (a mounted Secret), so
    clients cannot compute which keys are in a share. Replicas sharing it agree on membership.
    Without it (nor ``secret_env``) each process draws its own secret at start."""
    secret_env: str | None = None
    """The membership secret from this environment variable."""

    @model_validator(mode="after")
    def _one_secret(self) -> CanaryConfig:
        if self.secret_file is not None and self.secret_env is not None:
            raise ValueError("the canary secret comes from one source; secret_file and "
                             "secret_env are both set")
        self.resolve_secret()
        return self

    def resolve_secret(self) -> str | None:
        """The membership secret (read now); None when none is configured."""
        return read_secret("secret", None, self.secret_file, self.secret_env,
                           "share membership would be computable by clients")


class KServeV2Config(Strict):
    """How the KServe v2 fronts answer what is not inference: the repository API and server
    metadata. Both speak for one Triton backend (``backend``)."""

    repository_api: bool = False
    """Forward repository index / load / unload to the backend. Off (the default): both fronts
    refuse them alike (gRPC UNIMPLEMENTED, HTTP 501, a JSON error saying how to turn it on).
    On: every call needs the admin token (``Authorization: Bearer <token>``, on gRPC as
    ``authorization`` metadata), since loading or unloading changes what every client gets;
    the token is ``listeners.admin``'s and must be set."""
    backend: str | None = None
    """The Triton backend (triton_grpc or triton_http) the repository API and ``backend``
    server metadata speak for; the only Triton backend when absent."""
    server_metadata: Literal["backend", "mmguard"] = "backend"
    """``backend``: ServerMetadata answers the backend's own name, version and extensions (so
    clients that check for Triton keep working), less the extensions mmguard refuses, plus
    ``mmguard``; the answer carries an ``mmguard-version`` header (gRPC: initial metadata).
    ``mmguard``: mmguard's own name, version and extensions. Falls back to ``mmguard`` when no
    single Triton backend is configured or the backend does not answer."""


class FilterSpec(Strict):
    name: str
    config: Any


class ModelRoute(Strict):
    name: str
    """The model name clients use."""
    backend: str
    backend_model: str | None = None
    """The name the backend knows; defaults to ``name``."""
    version: str = ""
    filters: tuple[dict[str, Any], ...] | None = None
    """Filter chain, outermost first, as ``- <filter>: {options}``; defaults.filters when absent."""
    timeout_s: float | None = Field(None, gt=0)
    """Overall deadline for this model (the client's own deadline still wins when shorter)."""


class Defaults(Strict):
    filters: tuple[dict[str, Any], ...] = ({"limits": {}},)


class TelemetryConfig(Strict):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector for traces; tracing export is off without it."""
    service_name: str = "mmguard"
    access_log_sample: float = Field(0.0, ge=0, le=1)
    """Share of requests that write an access log line at INFO (0: none, the default; every
    decision is still a header, a metric and a span event, and a DEBUG log line)."""


class SharedMemoryConfig(Strict):
    """Triton's system shared memory extension on the v2 fronts (docs/shared-memory.md)."""

    system: bool = False
    """Serve system shared memory: clients on this host (loopback peers only) register regions of
    /dev/shm and send/receive tensors in them. Off: the register/status/unregister calls and any
    tensor in a region answer UNIMPLEMENTED / 501 saying how to turn it on."""
    allowed_uids: tuple[int, ...] | None = None
    """If set, only client processes running as one of these uids may use shared memory (the uid
    is asked of the kernel for the client's socket, never read from the request)."""
    max_regions_per_client: int = Field(64, ge=1)
    """Regions one client uid may hold registered at once."""
    max_region_bytes: int = Field(1024 * MiB, gt=0)
    """The largest region a client may register (mmguard maps it whole)."""
    zero_copy: bool = False
    """Map regions and read input tensors in place (a memoryview over the mapping) instead of one
    pread per tensor. Only for clients trusted not to crash mmguard: a client that shrinks its
    file while it is mapped makes the next read of it kill mmguard with SIGBUS, and one that
    rewrites its region while its request is in flight can make the backend see other bytes than
    the filters checked. Off: each tensor is copied once, and a shrunk file is a clear error."""


class Config(Strict):
    listeners: Listeners = Listeners()
    backends: tuple[BackendConfig, ...]
    models: tuple[ModelRoute, ...]
    defaults: Defaults = Defaults()
    telemetry: TelemetryConfig = TelemetryConfig()
    openai: OpenAIConfig = OpenAIConfig()
    canary: CanaryConfig = CanaryConfig()
    shared_memory: SharedMemoryConfig = SharedMemoryConfig()
    v2: KServeV2Config = KServeV2Config()
    contract_refresh_s: float = Field(30.0, gt=0)
    """How often each backend's contract is re-read (a model reload is noticed within this)."""
    shutdown_grace_s: float = Field(10.0, ge=0)
    watch_config_s: float = Field(2.0, ge=0)
    """How often the config file and the TLS files it names are checked for a change (a
    ConfigMap update is a symlink swap); a change reloads as SIGHUP does. 0: not watched."""

    @model_validator(mode="after")
    def _references(self) -> Config:
        names = [b.name for b in self.backends]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"backend names must be unique; repeated: {sorted(dup)}")
        models = [m.name for m in self.models]
        dup = {n for n in models if models.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique; repeated: {sorted(dup)}")
        listed = {b.name: b.models for b in self.backends
                  if isinstance(b, OnnxRuntimeBackend) and b.models is not None}
        for m in self.models:
            if m.backend not in names:
                raise ValueError(f"model '{m.name}' names backend '{m.backend}', "
                                 f"which is not among the backends {names}")
            wanted = m.backend_model or m.name
            if m.backend in listed and wanted not in listed[m.backend]:
                raise ValueError(f"model '{m.name}' asks backend '{m.backend}' for "
                                 f"'{wanted}', which is not among the models it loads "
                                 f"{list(listed[m.backend])}")
        return self

    @model_validator(mode="after")
    def _v2_backend(self) -> Config:
        tritons = [b.name for b in self.backends if b.kind in ("triton_grpc", "triton_http")]
        v2 = self.v2
        if v2.backend is not None and v2.backend not in tritons:
            raise ValueError(f"v2.backend '{v2.backend}' is not a Triton backend (Triton "
                             f"backends: {tritons})")
        if v2.repository_api:
            if v2.backend is None and len(tritons) != 1:
                raise ValueError(f"v2.repository_api needs one Triton backend to speak for: "
                                 f"set v2.backend (Triton backends: {tritons})")
            if not self.listeners.admin._token_digest:
                raise ValueError("v2.repository_api needs the admin token (listeners.admin."
                                 "token, token_file or token_env): without it anyone could "
                                 "load and unload models")
        return self

    def v2_backend(self) -> str | None:
        """The Triton backend the v2 repository API and server metadata speak for, if any."""
        if self.v2.backend is not None:
            return self.v2.backend
        tritons = [b.name for b in self.backends if b.kind in ("triton_grpc", "triton_http")]
        return tritons[0] if len(tritons) == 1 else None

    def route_filters(self, route: ModelRoute) -> tuple[dict[str, Any], ...]:
        return route.filters if route.filters is not None else self.defaults.filters


class ConfigError(Exception):
    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        super().__init__(f"{source} is invalid:\n" + "\n".join(f"  {p}" for p in problems))


def resolve_filters(entries: tuple[dict[str, Any], ...], path: str) -> list[FilterSpec]:
    """Validate a filter list against each filter's own config model."""
    factories = filter_factories()
    specs, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict) or len(entry) != 1:
            problems.append(f"{where}: each filter is a one-key mapping '<filter>: {{options}}'")
            continue
        (name, options), = entry.items()
        if name not in factories:
            problems.append(f"{where}: unknown filter '{name}' (known: {sorted(factories)})")
            continue
        try:
            cfg = factories[name].config_model.model_validate(options or {})
        except ValidationError as exc:
            problems.extend(_format(exc, f"{where}.{name}"))
            continue
        specs.append(FilterSpec(name=name, config=cfg))
    if problems:
        raise ConfigError(problems)
    return specs


def parse_config(doc: Any, source: str = "config") -> Config:
    """Validate a document: every model, every filter's options, and what they name."""
    if doc is None:
        raise ConfigError(["the file is empty"], source)
    try:
        cfg = Config.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(_format(exc, ""), source) from None
    problems: list[str] = []
    try:
        resolve_filters(cfg.defaults.filters, "defaults.filters")
    except ConfigError as err:
        problems.extend(err.problems)
    for i, route in enumerate(cfg.models):
        if route.filters is None:
            continue
        try:
            resolve_filters(route.filters, f"models[{i}].filters")
        except ConfigError as err:
            problems.extend(err.problems)
    if not problems:
        problems = reference_problems({m.name for m in cfg.models}, _route_references(cfg))
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _route_references(cfg: Config) -> list[tuple[str, ConfigReferences]]:
    """(where, references) of every filter of every route, as the route runs it."""
    found = []
    for i, route in enumerate(cfg.models):
        where = f"models[{i}].filters" if route.filters is not None else "defaults.filters"
        for j, spec in enumerate(resolve_filters(cfg.route_filters(route), where)):
            refs = getattr(spec.config, "references", None)
            if refs is not None:
                found.append((f"models[{i}] ({route.name}): {where}[{j}].{spec.name}", refs()))
    return found


def load_config(path: str | Path, *, check_files: bool = False) -> Config:
    """Read, parse and validate a config file; every problem is one line of the ConfigError.
    ``check_files`` also checks what the config names on this machine (``file_problems``):
    ``serve``, reloads and ``check-config`` do; a config checked elsewhere need not."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc}"], str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([f"not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} "
                           f"(offset {exc.start}); save the file as UTF-8"], str(path)) from None
    with _no_cyclic_gc():
        try:
            doc = yaml.load(text, Loader=_Loader)  # a safe loader (libyaml's when available)
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {exc}"], str(path)) from None
        except ValueError as exc:  # int() past Python's digit limit, from the YAML constructor
            raise ConfigError([unreadable_value(exc)], str(path)) from None
        cfg = parse_config(doc, str(path))
    if check_files and (problems := file_problems(cfg)):
        raise ConfigError(problems, str(path))
    return cfg


def file_problems(cfg: Config) -> list[str]:
    """What ``serve`` would find missing on this machine: model directories and the models
    listed in them, and the files filters read when built."""
    problems = []
    for i, b in enumerate(cfg.backends):
        if isinstance(b, OnnxRuntimeBackend):
            problems += model_dir_problems(f"backends[{i}] ({b.name})", b.model_dir, b.models)
    for where, refs in _route_references(cfg):
        problems += [f"{where}.{option}: {path} is not a file"
                     for option, path in refs.files if not path.is_file()]
    return problems
    return cfg


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A large file makes millions of short-lived YAML nodes, and the cyclic collector rescans
    them all again and again while holding the GIL: a 15 MiB file loaded 3x slower, and the
    event loop (serving, while a reload loads in a thread) paused for seconds. Nodes form no
    cycles, so reference counting frees them; the collector is off only meanwhile."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader parses a large file several times faster; the same safe constructors."""


def _format(exc: ValidationError, prefix: str) -> list[str]:
    out = []
    for err in exc.errors():
        path = prefix
        for part in err["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part in ("triton_grpc", "triton_http", "onnxruntime", "vllm"):
                continue  # discriminator tag that pydantic adds to the location
            else:
                path += f".{part}" if path else str(part)
        out.append(f"{path or '(top level)'}: {err['msg']}")
    return out
