"""mmguard's configuration: one YAML file validated into frozen, typed models.

Unknown keys are refused everywhere (``extra="forbid"``). Errors name the key path and the reason,
e.g. ``models[0].filters[1].limits.max_batch: Input should be greater than 0``. Each filter's own
config model lives beside the filter and is found through its factory; ``load_config`` validates
those too, so ``mmguard check-config`` catches a bad filter option before anything serves.
"""

from __future__ import annotations

import hashlib
import os
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
    """Bodies above this are refused with 413 before they are read."""
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
    max_concurrent_streams: int | None = Field(None, gt=0)
    """Calls at once on one client connection (HTTP/2 SETTINGS); the client queues the rest.
    gRPC's own default when absent."""
    max_concurrent_requests: int | None = Field(None, gt=0)
    """Calls at once on the whole listener, health checks included; the next ones get
    RESOURCE_EXHAUSTED. Unlimited when absent."""

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
        if self.token is not None:
            token = self.token.get_secret_value()
            where = "token"
        elif self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"token_file: cannot read {self.token_file}: {exc}") from None
            where = f"token_file {self.token_file}"
        elif self.token_env is not None:
            token = os.environ.get(self.token_env, "").strip()
            where = f"token_env: environment variable {self.token_env}"
        else:
            return None
        if not token:
            raise ValueError(f"{where} is empty or unset: an empty admin token would let "
                             f"anyone act")
        return token


class Listeners(Strict):
    http: HttpListener = HttpListener()
    grpc: GrpcListener = GrpcListener()
    admin: AdminListener = AdminListener()


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

    @model_validator(mode="after")
    def _verify(self) -> TritonGrpcBackend:
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

    @model_validator(mode="after")
    def _scheme(self) -> TritonHttpBackend:
        _check_scheme(self.url, self.tls)
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
    """Header whose value picks the share; the request id when absent; random when neither."""


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


class Config(Strict):
    listeners: Listeners = Listeners()
    backends: tuple[BackendConfig, ...]
    models: tuple[ModelRoute, ...]
    defaults: Defaults = Defaults()
    telemetry: TelemetryConfig = TelemetryConfig()
    openai: OpenAIConfig = OpenAIConfig()
    canary: CanaryConfig = CanaryConfig()
    contract_refresh_s: float = Field(30.0, gt=0)
    """How often each backend's contract is re-read (a model reload is noticed within this)."""
    shutdown_grace_s: float = Field(10.0, ge=0)

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
        for m in self.models:
            if m.backend not in names:
                raise ValueError(f"model '{m.name}' names backend '{m.backend}', "
                                 f"which is not among the backends {names}")
        return self

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
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str | Path) -> Config:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc}"], str(path)) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], str(path)) from None
    return parse_config(doc, str(path))


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
